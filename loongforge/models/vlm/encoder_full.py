"""``parallel.encoder_dp=full``: the model-parallel group (TP x PP) divides a whole step's media.

Every rank of the group holds a whole encoder replica (vision TP 1), also on later pipeline
stages, and every rank receives all of the step's micro-batches. At the start of a step:

1. ``begin``: every medium of every micro-batch is assigned to a rank of the group by modelled
   cost (``parallel.media_assign.assign_step_media``, the same on every rank); each rank encodes
   its share in one encoder forward, with autograd, and keeps the graph; the merged features are
   gathered (``parallel.encoder_dp.gather_rows``) and the first-stage ranks hold them as one leaf
   tensor that requires grad.
2. ``take``, once per micro-batch in order on the first stage: that micro-batch's rows of the
   leaf, instead of running the encoder; the pipeline's backward accumulates their gradient in
   the leaf's ``.grad``.
3. ``finish``, after the pipeline flush and before megatron's gradient reduction: the leaf's
   gradient is broadcast from the first stage (its TP ranks hold identical copies: the gradient of
   the language model's input is all-reduced over TP before it leaves the first layer), each rank
   runs its encoder backward on its own rows into separate tensors (``torch.autograd.grad``), and
   the encoder gradients are summed over the group. The caller adds them to megatron's DDP.

Summing over the group before the data-parallel reduction keeps the distributed optimizer right:
every replica's ``main_grad`` holds the whole step's gradient before DDP reduces and shards it.

Memory (``recompute``): keeping the graph of step 1 holds a rank's whole share of the step's
encoder activations, micro-batches / (TP x PP) micro-batches' worth, through the pipeline. With
``parallel.encoder_full_recompute=true`` step 1 encodes without a graph, and step 3 encodes the
rank's media again with one, a group of media at most one micro-batch's patches at a time, each
group's backward before the next group's forward: a rank then never holds more encoder
activations than ``encoder_dp=none`` holds for one micro-batch, plus the step's gathered features,
at the price of a second encoder forward.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from loongforge.parallel.encoder_dp import gather_rows, sum_over_group
from loongforge.parallel.media_assign import StepMedia, VisionCost, assign_step_media

# (pixel rows [P, C*T*p*p], grid_thw [n, 3]) -> merged features [P / merge_unit, h]
Encode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# One micro-batch's media: (pixel rows [P, C*T*p*p], grid_thw [n, 3]), both None without media.
MicroBatchMedia = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]


class StepEncoding:
    """One step's encoder work, divided over ``group`` (the model-parallel group).

    ``role``: this rank's (pipeline rank, TP rank); the features' gradient is broadcast from the
    group's (0, 0), the first stage's TP rank 0 (found at the first ``begin``: a collective at build
    time could meet a stage's other collectives, such as the tied embedding's, in another order);
    ``receives``: whether this rank's pipeline stage embeds (the first stage);
    ``vision_cost``: called at every step for the current cost coefficients;
    ``recompute``: encode without a graph and again in ``finish`` (the module docstring's memory).
    """

    def __init__(self, group: dist.ProcessGroup, *, role: tuple[int, int], receives: bool, merge_unit: int,
                 width: int, dtype: torch.dtype, vision_cost: Callable[[], VisionCost], recompute: bool = False):
        self.group = group
        self.role = role
        self.grad_source: Optional[int] = None
        self.receives = receives
        self.merge_unit = merge_unit
        self.width = width
        self.dtype = dtype
        self.vision_cost = vision_cost
        self.recompute = recompute
        self._media: Optional[StepMedia] = None
        # recompute: how to encode, this rank's media (pixel rows, grids) and the most patches one
        # group of them may have (the step's largest micro-batch's)
        self._encode: Optional[Encode] = None
        self._mine: MicroBatchMedia = (None, None)
        self._group_patches = 0
        self._local: Optional[torch.Tensor] = None  # [n_mine, width], with the encoder's graph
        self._features: Optional[torch.Tensor] = None  # [N, width] leaf (first stage only)
        self._next_micro_batch = 0

    def _first_stage_tp_rank_0(self) -> int:
        """The global rank of role (0, 0) in the group (a collective over it)."""
        roles = [None] * self.group.size()
        dist.all_gather_object(roles, self.role, group=self.group)
        return dist.get_process_group_ranks(self.group)[roles.index((0, 0))]

    @property
    def active(self) -> bool:
        """Between ``begin`` and ``finish``: the micro-batches' features come from ``take``."""
        return self._media is not None

    def begin(self, encode: Encode, micro_batches: Sequence[MicroBatchMedia],
              device: torch.device) -> int:
        """Encode this rank's share of the step's media and gather everyone's features. Collective
        over the group. Returns the bytes held for the step (pixels encoded here, this rank's
        features, the gathered features)."""
        if self.active:
            raise RuntimeError("StepEncoding.begin called twice without finish")
        if self.grad_source is None:
            self.grad_source = self._first_stage_tp_rank_0()
        grids = [grid for _, grid in micro_batches]
        patches = [[] if grid is None else grid.prod(-1).tolist() for grid in grids]
        media = assign_step_media(patches, self.group.size(), merge_unit=self.merge_unit,
                                  cost=self.vision_cost())
        rank = dist.get_rank(self.group)
        pixels, grid_thw = _select_media(micro_batches, media, media.media_of(rank))
        if grid_thw is None:
            local = torch.zeros(0, self.width, dtype=self.dtype, device=device)
        else:
            with torch.no_grad() if self.recompute else contextlib.nullcontext():
                local = encode(pixels.to(device), grid_thw.to(device)).to(self.dtype)  # [n_mine, width]
        gathered = gather_rows(local, self.group, [media.rows_of(r) for r in range(self.group.size())])
        self._media, self._local, self._next_micro_batch = media, local, 0
        if self.recompute:
            self._encode, self._mine = encode, (pixels, grid_thw)
            self._group_patches = max(sum(p) for p in patches)
        if self.receives:
            self._features = gathered.requires_grad_(True)
        held = [local, gathered] + ([] if pixels is None else [pixels])
        return sum(t.numel() * t.element_size() for t in held)

    def take(self, grid_thw: Optional[torch.Tensor]) -> torch.Tensor:
        """The next micro-batch's merged features [P / merge_unit, width], a slice of the leaf."""
        if not self.receives or not self.active:
            raise RuntimeError("StepEncoding.take outside a step, or on a stage that does not embed")
        index = self._next_micro_batch
        if index >= len(self._media.media_per_micro_batch):
            raise RuntimeError(f"micro-batch {index + 1} embedded, but the step was encoded for "
                               f"{len(self._media.media_per_micro_batch)}")
        start, stop = self._media.micro_batch_rows(index)
        expected = 0 if grid_thw is None else int(grid_thw.prod(-1).sum()) // self.merge_unit
        if stop - start != expected:
            raise RuntimeError(f"micro-batch {index} has {expected} merged patches, but the step's "
                               f"encoding gave it {stop - start}: micro-batches out of order?")
        self._next_micro_batch += 1
        return self._features[start:stop]

    def finish(self, trainable: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The encoder gradient of the whole step for each of ``trainable``, summed over the
        group (zeros where nothing reached a parameter). Collective over the group."""
        if not self.active:
            raise RuntimeError("StepEncoding.finish without begin")
        media, local = self._media, self._local
        total_rows = media.row_starts[-1]
        grad_full = local.new_zeros(total_rows, self.width)  # [N, width]
        if self._features is not None and self._features.grad is not None:
            grad_full.copy_(self._features.grad)
        if total_rows and self.group.size() > 1:
            dist.broadcast(grad_full, src=self.grad_source, group=self.group)
        my_rows = media.rows_of(dist.get_rank(self.group))
        if self.recompute:
            grads = self._recomputed_backward(trainable, grad_full, my_rows)
        else:
            grads = self._encoder_backward(trainable, grad_full, my_rows)
        sum_over_group(grads, self.group)
        self._media = self._local = self._features = self._encode = None
        self._mine = (None, None)
        return grads

    def _encoder_backward(self, trainable: Sequence[torch.nn.Parameter], grad_full: torch.Tensor,
                          my_rows: list[int]) -> list[torch.Tensor]:
        """This rank's encoder backward on its own rows, into new tensors (``autograd.grad``
        leaves ``.grad`` and megatron's DDP hooks alone)."""
        local = self._local
        grads: Sequence[Optional[torch.Tensor]] = [None] * len(trainable)
        if my_rows and local.requires_grad and trainable:
            rows = torch.tensor(my_rows, dtype=torch.long, device=grad_full.device)
            grads = torch.autograd.grad(local, list(trainable), grad_outputs=grad_full[rows],
                                        allow_unused=True)
        return [torch.zeros_like(param) if grad is None else grad
                for param, grad in zip(trainable, grads)]

    def _recomputed_backward(self, trainable: Sequence[torch.nn.Parameter], grad_full: torch.Tensor,
                             my_rows: list[int]) -> list[torch.Tensor]:
        """``_encoder_backward`` with the forward run again, one group of this rank's media at a
        time (at most ``_group_patches`` patches, or one medium that has more): each group's graph
        is freed by its backward before the next group is encoded."""
        totals = [torch.zeros_like(param) for param in trainable]
        pixels, grid_thw = self._mine
        if grid_thw is None or not trainable:
            return totals
        patches = grid_thw.prod(-1).tolist()
        pixel_start = row_start = 0
        for first, stop in _media_groups(patches, self._group_patches):
            count = sum(patches[first:stop])
            rows = count // self.merge_unit
            with torch.enable_grad():
                features = self._encode(pixels[pixel_start:pixel_start + count].to(grad_full.device),
                                        grid_thw[first:stop].to(grad_full.device)).to(self.dtype)  # [rows, width]
            index = torch.tensor(my_rows[row_start:row_start + rows], dtype=torch.long, device=grad_full.device)
            grads = torch.autograd.grad(features, list(trainable), grad_outputs=grad_full[index], allow_unused=True)
            for total, grad in zip(totals, grads):
                if grad is not None:
                    total.add_(grad)
            pixel_start, row_start = pixel_start + count, row_start + rows
        return totals


def _media_groups(patches: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """[first, stop) runs of consecutive media with at most ``budget`` patches each (a medium with
    more is a group of its own)."""
    groups, first, held = [], 0, 0
    for index, count in enumerate(patches):
        if index > first and held + count > budget:
            groups.append((first, index))
            first, held = index, 0
        held += count
    if patches:
        groups.append((first, len(patches)))
    return groups


def _select_media(micro_batches: Sequence[MicroBatchMedia], media: StepMedia,
                  chosen: list[int]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The pixel rows [P, C*T*p*p] and grids [n, 3] of the ``chosen`` media (step numbering),
    concatenated in that order; (None, None) when none are chosen."""
    if not chosen:
        return None, None
    pixel_rows, grid_rows = [], []
    for pixels, grid in micro_batches:
        if grid is None:
            continue
        starts = [0] + grid.prod(-1).cumsum(0).tolist()
        pixel_rows += [pixels[starts[i]: starts[i + 1]] for i in range(len(grid))]
        grid_rows += list(grid)
    return torch.cat([pixel_rows[i] for i in chosen]), torch.stack([grid_rows[i] for i in chosen])
