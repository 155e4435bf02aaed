"""Which rank encodes which image or video: longest first onto the least-loaded rank.

With ``parallel.encoder_dp=tp`` the ranks of a language TP group share one micro-batch, and each
encodes only some of its images and videos (``parallel.encoder_dp``). Every rank computes the same
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
    """The owning rank (0 .. num_ranks-1) of each medium, given each one's patch count.

    Longest-processing-time greedy: media in decreasing cost (ties: lower index first) each go to
    the rank with the least cost so far (ties: lower rank). Deterministic in its inputs.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    costs = [cost.of(p) for p in patches]
    owners = [0] * len(costs)
    loads = [0.0] * num_ranks
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners
