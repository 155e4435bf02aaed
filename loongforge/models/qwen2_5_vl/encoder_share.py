"""``parallel.encoder_dp=tp``: the ranks of a language TP group divide a micro-batch's media.

Without it every rank of a TP group (vision TP 1: a whole encoder each) encodes every image and
video of the micro-batch they share: TP-fold redundant work. Here each rank encodes a share chosen
by modelled cost (``parallel.media_assign``, the same on every rank), the merged embeddings are
gathered in the original media order (``parallel.encoder_dp.gather_from_owners``), and in backward
each embedding's gradient goes back to the rank that encoded it. The caller sums the encoder's
gradients over the group after the data-parallel reduction (``parallel.encoder_dp.sum_encoder_grads``).

Media are the micro-batch's images then videos, the order of ``grid_thw`` [n, 3] (t, h, w): medium
i has ``t*h*w`` consecutive rows of ``pixel_values`` and ``t*h*w / merge_unit`` consecutive rows of
the merged features.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist

from loongforge.parallel.encoder_dp import gather_from_owners, touch_with_zero
from loongforge.parallel.media_assign import VisionCost, assign_media

# (pixel rows [P, C*T*p*p], grid_thw [n, 3]) -> merged features [P / merge_unit, h]
Encode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class SharedEncoding:
    """Encodes this rank's share of the media and gathers everyone's features.

    ``group``: the ranks sharing the micro-batch (the language TP group); ``vision_cost``: called
    at every micro-batch for the current cost coefficients (the run's cost model may be refitted);
    ``width`` and ``dtype``: of the merged features, for a rank that owns nothing.
    """

    def __init__(self, group: dist.ProcessGroup, *, merge_unit: int, width: int, dtype: torch.dtype,
                 vision_cost: Callable[[], VisionCost]):
        self.group = group
        self.merge_unit = merge_unit
        self.width = width
        self.dtype = dtype
        self.vision_cost = vision_cost

    def __call__(self, encode: Encode, trainable: Iterable[torch.nn.Parameter],
                 pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged features of every medium, in order: [P_total / merge_unit, width]."""
        patches = grid_thw.prod(-1).tolist()
        owners = assign_media(patches, self.group.size(), self.vision_cost())
        mine = [i for i, owner in enumerate(owners) if owner == dist.get_rank(self.group)]
        merged_starts = [0]
        for count in patches:
            merged_starts.append(merged_starts[-1] + count // self.merge_unit)
        owner_rows = [_rows([i for i, o in enumerate(owners) if o == rank], merged_starts)
                      for rank in range(self.group.size())]
        if mine:
            local = encode(_select_rows(pixels, patches, mine), grid_thw[mine])
        else:
            local = self._nothing(trainable, pixels.device)
        return gather_from_owners(local, self.group, owner_rows)

    def _nothing(self, trainable: Iterable[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
        """[0, width]: this rank encodes nothing, yet still reports a (zero) gradient for every
        trainable encoder parameter (``touch_with_zero``)."""
        return touch_with_zero(torch.zeros(0, self.width, dtype=self.dtype, device=device), trainable)


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
