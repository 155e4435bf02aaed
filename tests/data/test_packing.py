"""First-fit lookahead packing and the DP row split (pure functions)."""

import random

import pytest

from loongforge.data.packing import LookaheadPacker, PackItem, pack_lengths, rank_rows


def test_rows_hold_every_item_once_and_never_exceed_seq_len():
    rng = random.Random(0)
    lengths = [rng.randint(1, 512) for _ in range(2000)]
    rows = pack_lengths(lengths, seq_len=512, lookahead=16)
    flat = [i for row in rows for i in row]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
    # first-fit over a lookahead keeps rows full: > 85% of the tokens are real
    assert sum(lengths) / (512 * len(rows)) > 0.85


def test_first_fit_order_is_deterministic_and_oldest_first():
    assert pack_lengths([6, 6, 3, 4, 1], seq_len=10, lookahead=5) == [[0, 2, 4], [1, 3]]
    # a 2-item window: item 4 arrives only after item 3 failed to fit, and row 0 then stops
    assert pack_lengths([6, 6, 3, 4, 1], seq_len=10, lookahead=2) == [[0, 2], [1, 3], [4]]
    # the oldest item always opens the next row, so nothing starves
    assert pack_lengths([9, 9, 1, 1, 1], seq_len=10, lookahead=5) == [[0, 2], [1, 3], [4]]
    # lookahead 1 = next-fit in stream order, no reordering
    assert pack_lengths([5, 5, 6, 5], seq_len=10, lookahead=1) == [[0, 1], [2], [3]]


def test_many_short_items_fill_a_row_beyond_the_lookahead():
    rows = pack_lengths([10] * 100, seq_len=400, lookahead=4)
    assert [len(row) for row in rows] == [40, 40, 20]


def test_item_longer_than_seq_len_is_an_error():
    with pytest.raises(ValueError, match="seq_len"):
        LookaheadPacker(8, 2).next_row(lambda: PackItem("k", 9))


def test_rank_rows_split_is_contiguous_and_covers_the_step():
    assert [list(rank_rows(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(rank_rows(8, 0, 1)) == list(range(8))
    with pytest.raises(ValueError, match="global_batch_size"):
        rank_rows(6, 0, 4)


def test_packing_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, loongforge.data.packing; assert 'torch' not in sys.modules, 'packing pulled in torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_samples_are_packed_at_their_padded_length():
    """sample_multiple 4 (context parallelism at CP 2): 6 counts as 8, so 6 + 6 + 6 no longer fits 20."""
    assert pack_lengths([6, 6, 6], seq_len=20, lookahead=4) == [[0, 1, 2]]
    packer: LookaheadPacker[None] = LookaheadPacker(20, 4, sample_multiple=4)
    stream = iter(PackItem(key=i, length=6) for i in range(3))
    rows = []
    while row := packer.next_row(lambda: next(stream, None)):
        rows.append([item.key for item in row])
    assert rows == [[0, 1], [2]]
    with pytest.raises(ValueError, match="takes 24 tokens > seq_len 20"):
        LookaheadPacker(20, 4, sample_multiple=8).next_row(lambda: PackItem(key=0, length=17))
