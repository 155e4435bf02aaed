"""Which rank encodes which medium (parallel.encoder_dp=tp): longest first onto the least loaded."""

from __future__ import annotations

import pytest

from loongforge.parallel.media_assign import VisionCost, assign_media


def test_longest_first_onto_the_least_loaded_rank():
    # costs (P^2 + P): 16 -> 272, 64 -> 4160, 36 -> 1332, 4 -> 20, 64 -> 4160
    owners = assign_media([16, 64, 36, 4, 64], num_ranks=2)
    # visit order 1, 4 (ties: lower index first), 2, 0, 3; each onto the cheaper rank (ties: rank 0)
    assert owners == [1, 0, 0, 1, 1]


def test_deterministic_and_balanced_by_cost_not_count():
    patches = [256, 16, 16, 16, 16, 16, 16, 16, 16]
    assert assign_media(patches, 2) == assign_media(list(patches), 2)
    owners = assign_media(patches, 2)
    # The one big image outweighs all eight small ones together: it is alone on its rank.
    assert owners[0] == 0 and owners[1:] == [1] * 8


def test_the_cost_coefficients_decide():
    # Linear: 12 + 4 = 8 + 8; quadratic: 144 > 64 + 64 + 16, so the 12 is alone.
    assert assign_media([12, 8, 8, 4], 2, VisionCost(0.0, 1.0, 0.0)) == [0, 1, 1, 0]
    assert assign_media([12, 8, 8, 4], 2, VisionCost(1.0, 0.0, 0.0)) == [0, 1, 1, 1]
    # A per-medium overhead only: counts balance.
    assert assign_media([100, 1, 1, 1], 2, VisionCost(0.0, 0.0, 1.0)) == [0, 1, 0, 1]


def test_fewer_media_than_ranks_and_none_at_all():
    assert assign_media([4, 9], 4) == [1, 0]
    assert assign_media([], 2) == []
    assert assign_media([7], 1) == [0]


def test_bad_inputs():
    with pytest.raises(ValueError, match="num_ranks"):
        assign_media([1], 0)
    with pytest.raises(ValueError, match="not all 0"):
        VisionCost(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        VisionCost(-1.0, 1.0, 0.0)
