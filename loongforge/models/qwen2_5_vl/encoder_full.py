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
"""

from __future__ import annotations

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

    ``grad_source``: the global rank whose features' gradient is broadcast (first stage, TP rank 0);
    ``receives``: whether this rank's pipeline stage embeds (the first stage);
    ``vision_cost``: called at every step for the current cost coefficients.
    """

    def __init__(self, group: dist.ProcessGroup, *, grad_source: int, receives: bool, merge_unit: int,
                 width: int, dtype: torch.dtype, vision_cost: Callable[[], VisionCost]):
        self.group = group
        self.grad_source = grad_source
        self.receives = receives
        self.merge_unit = merge_unit
        self.width = width
        self.dtype = dtype
        self.vision_cost = vision_cost
        self._media: Optional[StepMedia] = None
        self._local: Optional[torch.Tensor] = None  # [n_mine, width], with the encoder's graph
        self._features: Optional[torch.Tensor] = None  # [N, width] leaf (first stage only)
        self._next_micro_batch = 0

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
        grids = [grid for _, grid in micro_batches]
        patches = [[] if grid is None else grid.prod(-1).tolist() for grid in grids]
        media = assign_step_media(patches, self.group.size(), merge_unit=self.merge_unit,
                                  cost=self.vision_cost())
        rank = dist.get_rank(self.group)
        pixels, grid_thw = _select_media(micro_batches, media, media.media_of(rank))
        if grid_thw is None:
            local = torch.zeros(0, self.width, dtype=self.dtype, device=device)
        else:
            local = encode(pixels.to(device), grid_thw.to(device)).to(self.dtype)  # [n_mine, width]
        gathered = gather_rows(local, self.group, [media.rows_of(r) for r in range(self.group.size())])
        self._media, self._local, self._next_micro_batch = media, local, 0
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
        grads = self._encoder_backward(trainable, grad_full, media.rows_of(dist.get_rank(self.group)))
        sum_over_group(grads, self.group)
        self._media = self._local = self._features = None
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
