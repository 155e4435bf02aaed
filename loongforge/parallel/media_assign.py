"""Which rank encodes which image, video or video frame: longest first onto the least-loaded rank.

With ``parallel.encoder_dp=tp`` the ranks of a language TP group share one micro-batch, and with
``parallel.encoder_cp`` the ranks of a CP group: each encodes some of its images and video frames
(``frame_costs``, ``deal``); with ``encoder_dp=full`` the ranks of a model-parallel group (TP x PP)
divide the whole media of a step's micro-batches (``assign_step_media``). Every rank computes the same
assignment from the same inputs (the media's patch counts and the cost coefficients), so the ranks
agree without communicating.

The cost of one medium of P vision patches (before the 2x2 merge) is the cost model's vision part,
``a * P^2 + b * P + c`` (``sum_P2``, ``sum_P``, ``n_img`` in ``balance.cost_model``): attention in
the full-attention blocks, the matmuls, a fixed per-medium overhead. Before a fit, P^2 + P.

Pure Python: no torch, no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class VisionCost:
    """Modelled encoder cost of one image or video: ``per_patch_squared * P^2 + per_patch * P +
    per_medium`` (any unit: only ratios matter). The default, P^2 + P, ranks media by size with
    attention dominating large ones, which is what a fitted model says on every device we measured."""

    per_patch_squared: float = 1.0
    per_patch: float = 1.0
    per_medium: float = 0.0

    def __post_init__(self):
        terms = (self.per_patch_squared, self.per_patch, self.per_medium)
        if min(terms) < 0 or sum(terms) <= 0:
            raise ValueError(f"vision cost coefficients must be >= 0 and not all 0, got {terms}")

    def of(self, patches: int) -> float:
        return self.per_patch_squared * patches * patches + self.per_patch * patches + self.per_medium


def assign_media(patches: Sequence[int], num_ranks: int, cost: VisionCost = VisionCost()) -> list[int]:
    """The owning rank (0 .. num_ranks-1) of each medium, given each one's patch count."""
    return deal([cost.of(p) for p in patches], num_ranks)


def deal(costs: Sequence[float], num_ranks: int) -> list[int]:
    """The owning rank (0 .. num_ranks-1) of each piece of work, given each one's cost.

    Longest-processing-time greedy: pieces in decreasing cost (ties: lower index first) each go to
    the rank with the least cost so far (ties: lower rank). Deterministic in its inputs.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    owners = [0] * len(costs)
    loads = [0.0] * num_ranks
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


def frame_costs(patches: Sequence[int], frames: Sequence[int], cost: VisionCost = VisionCost()) -> list[float]:
    """The modelled cost of every frame of every medium, media in order, each medium's frames in
    order: its cost spread evenly over its ``t`` frames (temporal patches, ``grid_thw``'s t).

    The vision towers attend within a frame (each frame is its own full-attention segment, windows
    and positions are per frame), so a video's frames can be encoded on different ranks and their
    features concatenated: one long video no longer lands on one rank. Spreading the medium's cost
    keeps the total what the cost model says for the medium.
    """
    if len(patches) != len(frames):
        raise ValueError(f"{len(patches)} patch counts for {len(frames)} frame counts")
    return [cost.of(p) / t for p, t in zip(patches, frames) for _ in range(t)]


@dataclass(frozen=True)
class StepMedia:
    """Every image and video of one step's micro-batches, divided among the ranks of a
    model-parallel group (``parallel.encoder_dp=full``).

    Media are numbered in step order: micro-batch 0's media (images, then videos: the order of its
    ``grid_thw``), then micro-batch 1's, and so on. Medium i has ``patches[i]`` vision patches and
    ``patches[i] // merge_unit`` rows of merged features; the step's features are the media's rows
    in step order.
    """

    patches: tuple[int, ...]
    owners: tuple[int, ...]  # the rank that encodes each medium
    media_per_micro_batch: tuple[int, ...]
    merge_unit: int

    @property
    def row_starts(self) -> list[int]:
        """The first merged-feature row of each medium, then the total: [n + 1]."""
        starts = [0]
        for count in self.patches:
            starts.append(starts[-1] + count // self.merge_unit)
        return starts

    def media_of(self, rank: int) -> list[int]:
        """The media ``rank`` encodes, in step order."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def rows_of(self, rank: int) -> list[int]:
        """The feature rows of ``rank``'s media, in the order it encodes them."""
        starts = self.row_starts
        return [row for i in self.media_of(rank) for row in range(starts[i], starts[i + 1])]

    def micro_batch_rows(self, index: int) -> tuple[int, int]:
        """[start, stop) of micro-batch ``index``'s feature rows."""
        first = sum(self.media_per_micro_batch[:index])
        starts = self.row_starts
        return starts[first], starts[first + self.media_per_micro_batch[index]]


def assign_step_media(patches_per_micro_batch: Sequence[Sequence[int]], num_ranks: int, *,
                      merge_unit: int, cost: VisionCost = VisionCost()) -> StepMedia:
    """Divide a step's media (patch counts per micro-batch, in order) among ``num_ranks`` ranks by
    modelled cost, over the whole step rather than micro-batch by micro-batch: a micro-batch with
    one large image no longer leaves the other ranks idle."""
    patches = tuple(int(p) for media in patches_per_micro_batch for p in media)
    bad = [p for p in patches if p % merge_unit]
    if bad:
        raise ValueError(f"patch counts {bad[:3]} are not multiples of the merge unit {merge_unit}")
    return StepMedia(patches=patches, owners=tuple(assign_media(patches, num_ranks, cost)),
                     media_per_micro_batch=tuple(len(media) for media in patches_per_micro_batch),
                     merge_unit=merge_unit)
