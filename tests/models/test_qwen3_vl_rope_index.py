"""Qwen3-VL position ids per sample equal transformers' ``Qwen3VLModel.get_rope_index``."""

import pytest
import torch

from loongforge.models.qwen3_vl.rope_index import get_rope_index, position_ids_for
from tests.models.test_qwen3_vl_support import build_hf_model, hf_position_ids, make_sample, tiny_model_cfg

LAYOUTS = {
    "text": dict(),
    "one_image": dict(images=((1, 8, 12),)),
    "two_images": dict(images=((1, 8, 12), (1, 6, 4))),
    "tall_image": dict(images=((1, 12, 4),)),
    "video": dict(videos=((3, 4, 6),)),
    "two_videos": dict(videos=((2, 4, 6), (4, 2, 2))),
    "image_and_video": dict(images=((1, 6, 4),), videos=((2, 4, 6),)),
}


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model(tiny_model_cfg())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_transformers(hf_model, layout):
    model_cfg = tiny_model_cfg()
    sample = make_sample(model_cfg, text_len=9, **LAYOUTS[layout])
    ours = position_ids_for(model_cfg)(sample.input_ids[0], sample.image_grid_thw, sample.video_grid_thw)
    assert torch.equal(ours, hf_position_ids(hf_model, sample)[:, 0])


def test_worked_example_of_the_docstring():
    tokens = tiny_model_cfg().tokens
    t, vs, ve, ts, pad = 1, tokens.vision_start_token_id, tokens.vision_end_token_id, 2, tokens.video_token_id
    input_ids = torch.tensor([t, vs, pad, pad, ve, ts, vs, pad, pad, ve, t])
    ids = get_rope_index(input_ids, video_grid_thw=torch.tensor([[2, 2, 4]]), spatial_merge_size=2,
                         image_token_id=tokens.image_token_id, video_token_id=pad, vision_start_token_id=vs)
    assert ids.tolist() == [[0, 1, 2, 2, 4, 5, 6, 7, 7, 9, 10],
                            [0, 1, 2, 2, 4, 5, 6, 7, 7, 9, 10],
                            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def test_video_frames_must_each_be_their_own_run():
    """The frames of a video written back to back (Qwen2.5-VL's layout) are one run, not grid_t."""
    tokens = tiny_model_cfg().tokens
    frames = torch.full((2 * 6,), tokens.video_token_id)
    input_ids = torch.cat([torch.tensor([5, tokens.vision_start_token_id]), frames, torch.tensor([6])])
    with pytest.raises(ValueError, match="1 video frame token runs in input_ids but the grids give 2"):
        position_ids_for(tiny_model_cfg())(input_ids, None, torch.tensor([[2, 4, 6]]))
