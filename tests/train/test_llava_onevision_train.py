"""LLaVA-OneVision (SigLIP + MLP + anyres packing + Qwen2, 1-D RoPE) trains through the same command on the
demo photos (one image a sample: its base square and anyres crops, packed by its size; two: a padded
square each): DP 2 with balancing re-planning every step, and TP 2 x PP 2 (vision TP 2), equal one
process (losses, grad norms and Adam moments, the newline and the projector included, to 1e-5
relative); stored embeddings (``loongforge encode``: each image's packed features) train like the frozen
online encoder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shared_data import SHARED_DATA
from tests.train.conftest import (
    SAVE_AT_END,
    assert_layout_trains_like_one_process,
    assert_stored_embeddings_train_like_the_frozen_encoder,
    layout_runs,
)

PRESET = "llava-onevision-tiny-small-vocab"
REL = 1e-5
DEMO_IMAGES = SHARED_DATA / "llamafactory" / "mllm_demo.json"
# Adam's epsilon at 1e-6 as in tests/train/test_qwen3_vl_train.py.
OPTIONS = ("data.source=files", f"data.paths=[{DEMO_IMAGES}]", "data.read=global", "data.seq_len=1024",
           "optimizer.adam_eps=1e-6", SAVE_AT_END)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return layout_runs(tmp_path_factory.mktemp("llava_onevision"), PRESET, *OPTIONS)


@pytest.mark.parametrize("layout", ["dp2", "tp2-pp2"])
def test_layout_trains_like_one_process(runs, layout):
    assert_layout_trains_like_one_process(runs, layout, REL,
                                          tensors=(".vision_model.pos_embed", ".image_newline", ".projector."))


def test_stored_embeddings_train_like_the_frozen_encoder(tmp_path):
    """`loongforge encode` stores each image's packed features (its anyres canvas with the newline, or a
    padded square's and the newline where a sample holds several images)."""
    assert_stored_embeddings_train_like_the_frozen_encoder(tmp_path, PRESET, DEMO_IMAGES, "data.seq_len=1024")
