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


def _version_measurer(preset: str, *overrides: str) -> tuple[SampleMeasurer, object]:
    """The tiny preset's measurer at the data settings (tile budget) of ``preset``'s published sizes."""
    cfg = load_run_config(preset, overrides=list(overrides))
    return SampleMeasurer(load_tokenizer(cfg.data.tokenizer), cfg.data, cfg.model), cfg


def test_each_version_tiles_and_templates_as_its_own_recipes():
    """InternVL2.5 writes its internvl2_5 system turn and trains on up to 6 tiles and a thumbnail; InternVL3.5
    writes no system turn and takes up to 12. The same 640 x 229 photo: 3 x 1 tiles and the thumbnail at 2.5's
    budget, 12 and the thumbnail at 3.5's."""
    photo = str(require(COCO_IMAGES / "000000161044.jpg"))
    turns = [Turn("user", "<image>Describe it."), Turn("assistant", "A photo.")]
    seen = {}
    for tiny, sized in (("internvl2.5-tiny", "internvl2.5-4b"), ("internvl3.5-tiny", "internvl3.5-8b")):
        max_tiles = load_run_config(sized).data.max_tiles
        measure, cfg = _version_measurer(tiny, f"data.max_tiles={max_tiles}")
        sample = measure.measure(ConversationSample("i:1", photo, 1, turns, images=[photo]))
        text = measure.tokenizer.decode(sample.input_ids)
        seen[tiny] = (max_tiles, sample.image_grids[0][0], "书生·万象" in text, text.startswith("<|im_start|>system"))
    print(f"\n(max_tiles, tiles with thumbnail, introduces itself, system turn): {seen}")
    assert seen == {"internvl2.5-tiny": (6, 4, True, True), "internvl3.5-tiny": (12, 13, False, False)}


def test_internvl2_5s_video_token_past_its_embedding_is_no_error_and_a_typed_token_past_it_is_a_reject():
    """InternVL2.5's tokenizer holds 151,675 ids (<video> at 151674, for its processor) over 151,674 embedding
    rows: a run starts, as the format never writes <video>. A vocabulary ending before the grounding tags
    rejects the sample that types one, naming it, instead of failing inside a step."""
    measure, cfg = _version_measurer("internvl2.5-tiny")
    assert (len(measure.tokenizer), cfg.model.language.vocab_size) == (151675, 151674)
    cut, _ = _version_measurer("internvl2.5-tiny", "model.language.vocab_size=151670")
    turns = [Turn("user", "Where is it? <box>"), Turn("assistant", "Left.")]
    rejected = cut.measure(ConversationSample("t:1", "f.json", 1, turns))
    print(f"\n{rejected.reason}: {rejected.detail}")
    assert isinstance(rejected, Reject) and rejected.reason == "beyond_vocabulary"
    assert rejected.detail.startswith("<box> (id 151672)")
    assert not isinstance(measure.measure(ConversationSample("t:1", "f.json", 1, turns)), Reject)
