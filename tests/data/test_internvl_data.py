"""InternVL's data path (its processor takes images only): a sample with a video is rejected with
``video_in_image_model``, naming the fix; an image sample's tokens are ``<img>`` + 4 ``<IMG_CONTEXT>`` a
tile + ``</img>`` at the tiny preset's 56-pixel tiles (the exported processor gives the same ids on a real
conversation: tests/convert/test_serve_ready.py)."""

from __future__ import annotations

import numpy as np

from loongforge.config.loader import load_run_config
from loongforge.data.measure import SampleMeasurer
from loongforge.data.samples import ConversationSample, Reject
from loongforge.data.template import Turn
from loongforge.data.tokenizer import load_tokenizer
from tests.data.conftest import COCO_IMAGES, LLAMAFACTORY, require


def measurer() -> SampleMeasurer:
    cfg = load_run_config("internvl3.5-tiny-small-vocab")
    return SampleMeasurer(load_tokenizer(cfg.data.tokenizer), cfg.data, cfg.model), cfg


def test_a_video_is_rejected_with_its_reason_and_an_image_is_wrapped_tiles():
    measure, cfg = measurer()
    video = str(require(LLAMAFACTORY / "mllm_demo_data" / "1.mp4"))
    turns = [Turn("user", "<video>What happens?"), Turn("assistant", "A baby puts on glasses.")]
    rejected = measure.measure(ConversationSample("v:1", video, 1, turns, videos=[video]))
    assert isinstance(rejected, Reject) and rejected.reason == "video_in_image_model"
    assert "give the frames as images" in rejected.detail
    photo = str(sorted(require(COCO_IMAGES).glob("*.jpg"))[0])
    turns = [Turn("user", "<image>Describe it."), Turn("assistant", "A photo.")]
    sample = measure.measure(ConversationSample("i:1", photo, 1, turns, images=[photo]))
    tokens = cfg.model.tokens
    (grid,) = sample.image_grids
    ids = sample.input_ids
    start = int(np.flatnonzero(ids == tokens.vision_start_token_id)[0])
    run = grid[0] * 4  # tiles x tokens a tile
    assert ids[start + 1:start + 1 + run].tolist() == [tokens.image_token_id] * run
    assert ids[start + 1 + run] == tokens.vision_end_token_id
    assert not sample.is_answer[start:start + run + 2].any()
    print(f"\nimage {grid}: {run} placeholders between <img> and </img>; video rejected: {rejected.detail}")
