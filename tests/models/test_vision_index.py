"""The ViT's index math equals transformers' (vision_utils) on odd grids, images and videos."""

import torch
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

from loongforge.models.towers.qwen2_5_vit.vision import window_partition
from loongforge.models.vlm.vision_common import frame_cu_seqlens, patch_positions

GRIDS = torch.tensor([[1, 8, 12], [1, 20, 16], [3, 6, 4], [2, 16, 16], [1, 2, 2]])
MERGE, WINDOW, PATCH = 2, 112, 14


def test_window_partition_matches_transformers():
    order, cu_seqlens = window_partition(GRIDS, MERGE, WINDOW // MERGE // PATCH)
    expected_order, expected_cu = get_vision_window_index(GRIDS, MERGE, WINDOW, PATCH)
    assert torch.equal(order, expected_order)
    assert torch.equal(cu_seqlens, expected_cu)


def test_patch_positions_match_transformers():
    assert torch.equal(patch_positions(GRIDS, MERGE), get_vision_position_ids(GRIDS, MERGE))


def test_full_attention_segments_are_frames():
    assert torch.equal(frame_cu_seqlens(GRIDS), get_vision_cu_seqlens(GRIDS))
