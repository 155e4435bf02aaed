"""The media batch (``models.media.MediaBatch``): its items are views of the stacked sets, in placeholder
order (images, then videos), each with its own rows, grid, size and the processor's facts; it moves whole."""

from __future__ import annotations

import torch

from loongforge.models.media import SECONDS_PER_GRID_T, MediaBatch, MediaSet


def _batch() -> MediaBatch:
    grids = torch.tensor([[1, 2, 2], [2, 1, 3]])  # 4 and 6 patch rows
    rows = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)
    images = MediaSet(grids=grids, rows=rows, sizes=torch.tensor([[28, 28], [14, 42]]),
                      facts={"wide": torch.tensor([0, 1])}, samples=(0, 1))
    videos = MediaSet(grids=torch.tensor([[2, 2, 2]]), rows=torch.ones(8, 3),
                      facts={SECONDS_PER_GRID_T: torch.tensor([0.5])}, samples=(1,))
    return MediaBatch(images=images, videos=videos)


def test_items_are_views_in_placeholder_order_with_their_own_facts():
    batch = _batch()
    items = list(batch.items())
    print(f"\nitems: {[(item.modality, item.grid, item.size) for item in items]}")
    assert [(item.modality, item.grid, item.size) for item in items] == [
        ("image", (1, 2, 2), (28, 28)), ("image", (2, 1, 3), (14, 42)), ("video", (2, 2, 2), None)]
    second = batch.images.rows[4:]
    assert torch.equal(items[1].rows, second) and items[1].rows.data_ptr() == second.data_ptr()  # a view
    assert [int(item.facts["wide"]) for item in items[:2]] == [0, 1]
    assert float(items[2].facts[SECONDS_PER_GRID_T]) == 0.5
    assert batch.images.patches == [4, 6] and len(batch.images) == 2


def test_it_moves_whole_and_an_empty_batch_is_falsy():
    batch = _batch()
    moved = batch.to(torch.device("cpu"))
    assert torch.equal(moved.images.rows, batch.images.rows) and torch.equal(moved.images.facts["wide"],
                                                                            batch.images.facts["wide"])
    assert moved.images.samples == (0, 1) and moved.videos.samples == (1,)
    assert batch and not MediaBatch() and MediaBatch().grids("image") is None
