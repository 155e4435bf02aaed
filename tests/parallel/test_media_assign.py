"""Which rank encodes which medium (parallel.encoder_dp=tp and full): longest first onto the least
loaded, per micro-batch (tp) or over a whole step's micro-batches (full)."""

from __future__ import annotations

import pytest

from loongforge.parallel.media_assign import VisionCost, assign_media, assign_step_media


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


def test_a_step_is_divided_as_one_list_in_micro_batch_order():
    # Micro-batches: [16, 64] (images then videos), [] (text only), [36], [4, 64].
    step = assign_step_media([[16, 64], [], [36], [4, 64]], 2, merge_unit=4)
    assert step.owners == tuple(assign_media([16, 64, 36, 4, 64], 2)) == (1, 0, 0, 1, 1)
    assert step.media_per_micro_batch == (2, 0, 1, 2)
    # Merged rows per medium: 4, 16, 9, 1, 16.
    assert step.row_starts == [0, 4, 20, 29, 30, 46]
    assert [step.micro_batch_rows(m) for m in range(4)] == [(0, 20), (20, 20), (20, 29), (29, 46)]
    assert step.media_of(0) == [1, 2] and step.media_of(1) == [0, 3, 4]
    # Each rank's rows in the order it encodes them: every row exactly once over the ranks.
    assert step.rows_of(0) == list(range(4, 29))
    assert step.rows_of(1) == [0, 1, 2, 3, 29, *range(30, 46)]
    assert sorted(step.rows_of(0) + step.rows_of(1)) == list(range(46))


def test_a_step_with_more_ranks_than_media_or_no_media():
    step = assign_step_media([[8], [4]], 4, merge_unit=4)
    assert step.media_of(2) == [] and step.rows_of(3) == []
    empty = assign_step_media([[], []], 4, merge_unit=4)
    assert empty.row_starts == [0] and empty.micro_batch_rows(1) == (0, 0)
    with pytest.raises(ValueError, match="merge unit 4"):
        assign_step_media([[6]], 2, merge_unit=4)
