"""Ranks that share a micro-batch divide its media: ``parallel.encoder_dp=tp`` (the language TP
group) and ``parallel.encoder_cp`` (the CP group, or TP x CP with both).

Without it every rank of the group (vision TP 1: a whole encoder each) encodes every image and video
of the micro-batch they share: group-fold redundant work. Here each rank encodes a share of the
frames chosen by modelled cost (``parallel.media_assign``, the same on every rank), the merged
features are gathered in the original order (``parallel.encoder_dp.gather_from_owners``), and in
backward each feature's gradient goes back to the rank that encoded it.

The unit dealt is a frame (one temporal patch, ``grid_thw``'s t; an image is one frame): the towers
attend within a frame, so a long video, the reason for CP, is spread over the group instead of
landing whole on one rank.

Whose gradients those are differs. TP ranks compute the same loss on the same tokens, so each holds
the whole gradient of every feature: the owner takes its rows, and the caller sums the encoder's
parameter gradients over the TP group after the data-parallel reduction
(``parallel.encoder_dp.sum_encoder_grads``). CP ranks each hold the gradient of their own tokens only:
the feature gradients are summed over the CP group first (``gradient_group``), and megatron's
data-parallel reduction, which runs over DP x CP, sums the parameter gradients.

Media are the micro-batch's images then videos, the order of ``grid_thw`` [n, 3] (t, h, w): medium
i has ``t*h*w`` consecutive rows of ``pixel_values`` and ``t*h*w / merge_unit`` consecutive rows of
the merged features, frame after frame (``h*w`` and ``h*w / merge_unit`` rows each).
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Optional

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from loongforge.config.schema import ParallelConfig
from loongforge.parallel.encoder_dp import gather_from_owners, touch_with_zero
from loongforge.parallel.media_assign import VisionCost, deal, frame_costs

# (pixel rows [P, C*T*p*p], grid_thw [n, 3]) -> merged features [P / merge_unit, h]
Encode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class SharingGroups(NamedTuple):
    group: dist.ProcessGroup  # the ranks that divide a micro-batch's media
    gradient_group: Optional[dist.ProcessGroup]  # the CP group when CP ranks share, else None
    tp_shares: bool  # the language TP ranks share (their parameter gradients are summed over TP)


def sharing_groups(parallel_cfg: ParallelConfig, pgs: ProcessGroupCollection) -> Optional[SharingGroups]:
    """Who divides a micro-batch's media: the TP group (``encoder_dp=tp``), the CP group
    (``encoder_cp`` at CP > 1, with ``encoder_dp`` none or tp), both (TP x CP), or nobody (None).
    ``encoder_dp=full`` divides whole steps instead (``encoder_full``)."""
    tp_shares = parallel_cfg.encoder_dp == "tp" and pgs.tp.size() > 1
    cp_shares = parallel_cfg.encoder_cp and pgs.cp.size() > 1 and parallel_cfg.encoder_dp != "full"
    if tp_shares and cp_shares:
        return SharingGroups(pgs.tp_cp, pgs.cp, True)
    if cp_shares:
        return SharingGroups(pgs.cp, pgs.cp, False)
    if tp_shares:
        return SharingGroups(pgs.tp, None, True)
    return None


class SharedEncoding:
    """Encodes this rank's share of the media and gathers everyone's features.

    ``group``: the ranks sharing the micro-batch (the language TP group, the CP group, or TP x CP);
    ``gradient_group``: the CP group when CP ranks share (their feature gradients are summed over it
    in backward), else None; ``vision_cost``: called at every micro-batch for the current cost
    coefficients (the run's cost model may be refitted); ``width`` and ``dtype``: of the merged
    features, for a rank that owns nothing.
    """

    def __init__(self, group: dist.ProcessGroup, *, merge_unit: int, width: int, dtype: torch.dtype,
                 vision_cost: Callable[[], VisionCost], gradient_group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self.gradient_group = gradient_group
        self.merge_unit = merge_unit
        self.width = width
        self.dtype = dtype
        self.vision_cost = vision_cost

    def __call__(self, encode: Encode, trainable: Iterable[torch.nn.Parameter],
                 pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged features of every medium, in order: [P_total / merge_unit, width]."""
        frames = frame_grids(grid_thw)  # [F, 3]: (1, h, w) per frame
        patches = frames.prod(-1).tolist()
        owners = deal(frame_costs(grid_thw.prod(-1).tolist(), grid_thw[:, 0].tolist(), self.vision_cost()),
                      self.group.size())
        mine = [i for i, owner in enumerate(owners) if owner == dist.get_rank(self.group)]
        merged_starts = [0]
        for count in patches:
            merged_starts.append(merged_starts[-1] + count // self.merge_unit)
        owner_rows = [_rows([i for i, o in enumerate(owners) if o == rank], merged_starts)
                      for rank in range(self.group.size())]
        if mine:
            local = encode(_select_rows(pixels, patches, mine), frames[mine])
        else:
            local = self._nothing(trainable, pixels.device)
        return gather_from_owners(local, self.group, owner_rows, gradient_group=self.gradient_group)

    def _nothing(self, trainable: Iterable[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
        """[0, width]: this rank encodes nothing, yet still reports a (zero) gradient for every
        trainable encoder parameter (``touch_with_zero``)."""
        return touch_with_zero(torch.zeros(0, self.width, dtype=self.dtype, device=device), trainable)


def frame_grids(grid_thw: torch.Tensor) -> torch.Tensor:
    """grid_thw [n, 3] (t, h, w) -> [sum(t), 3]: a (1, h, w) row for every frame, in order."""
    single = torch.cat([torch.ones_like(grid_thw[:, :1]), grid_thw[:, 1:]], dim=1)
    return torch.repeat_interleave(single, grid_thw[:, 0], dim=0)


def _rows(media: list[int], starts: list[int]) -> torch.Tensor:
    """Row indices [n] of the given media's merged features, media in the order given."""
    ranges = [torch.arange(starts[i], starts[i + 1]) for i in media]
    return torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.long)


def _select_rows(pixels: torch.Tensor, patches: list[int], media: list[int]) -> torch.Tensor:
    """The pixel rows of the given media, concatenated in that order."""
    starts = [0]
    for count in patches:
        starts.append(starts[-1] + count)
    return torch.cat([pixels[starts[i]: starts[i + 1]] for i in media])
