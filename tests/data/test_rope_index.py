"""get_rope_index equals transformers' Qwen2_5_VLModel.get_rope_index, sample by sample."""

import pytest
import torch

from loongforge.models.qwen2_5_vl.rope_index import get_rope_index

IMAGE, VIDEO, VSTART, VEND = 151655, 151656, 151652, 151653
TOKENS_PER_SECOND = 2


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=152064,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           tokens_per_second=TOKENS_PER_SECOND, fullatt_block_indexes=[0]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
    )
    return Qwen2_5_VLModel(config).eval()


def _hf_positions(model, ids, image_grid, video_grid, seconds):
    token_type = torch.zeros_like(ids)
    token_type[ids == IMAGE] = 1
    token_type[ids == VIDEO] = 2
    positions, _ = model.get_rope_index(
        ids[None], token_type[None], image_grid_thw=image_grid, video_grid_thw=video_grid,
        second_per_grid_ts=torch.tensor(seconds) if seconds is not None else None,
    )
    return positions[:, 0]  # [3, L]


def _block(pad_id, grid):
    t, h, w = grid
    return [VSTART] + [pad_id] * (t * h * w // 4) + [VEND]


def _ours(ids, image_grid, video_grid, seconds):
    return get_rope_index(ids, image_grid, video_grid, seconds, spatial_merge_size=2, image_token_id=IMAGE,
                          video_token_id=VIDEO, vision_start_token_id=VSTART, tokens_per_second=TOKENS_PER_SECOND)


CASES = {
    "text": ([], []),
    "image": ([(1, 4, 6)], []),
    "two_images": ([(1, 12, 22), (1, 8, 4)], []),
    "video": ([], [(9, 26, 46)]),
    "image_and_video": ([(1, 14, 22)], [(3, 4, 4)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rope_index_matches_transformers(hf_model, case):
    images, videos = CASES[case]
    ids = [9707, 1879, 0]
    for grid in images:
        ids += _block(IMAGE, grid) + [100, 200]
    for grid in videos:
        ids += _block(VIDEO, grid) + [300]
    ids = torch.tensor(ids + [151645, 198])
    image_grid = torch.tensor(images) if images else None
    video_grid = torch.tensor(videos) if videos else None
    seconds = [1.08] * len(videos) if videos else None
    ours = _ours(ids, image_grid, video_grid, seconds)
    assert ours.shape == (3, len(ids)) and ours.dtype == torch.long
    assert torch.equal(ours, _hf_positions(hf_model, ids, image_grid, video_grid, seconds))


def test_docstring_worked_example():
    ids = torch.tensor([1, 2] + _block(IMAGE, (1, 4, 6)) + [3])
    ours = _ours(ids, torch.tensor([[1, 4, 6]]), None, None)
    assert ours.tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7],
    ]


def test_grid_mismatch_is_loud():
    ids = torch.tensor([1] + _block(IMAGE, (1, 4, 4)))
    with pytest.raises(ValueError, match="grid"):
        _ours(ids, torch.tensor([[1, 4, 6]]), None, None)
