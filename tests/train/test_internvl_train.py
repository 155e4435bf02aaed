"""InternVL3.5 (InternViT + pixel shuffle + Qwen3, 1-D RoPE) trains through the same command on the demo
photos, tiled by its processor: DP 2 with balancing re-planning every step, and TP 2 x PP 2 (vision TP
2), equal one process (losses, grad norms and Adam moments, the tower's class token, positions and
layer scales included, to 1e-5 relative); stored embeddings (``loongforge encode``) train like the
frozen online encoder."""

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

PRESET = "internvl3.5-tiny-small-vocab"
REL = 1e-5
DEMO_IMAGES = SHARED_DATA / "llamafactory" / "mllm_demo.json"
# The demo photos at up to 4 tiles and a thumbnail of 56 px (20 tokens an image); Adam's epsilon at
# 1e-6 as in tests/train/test_qwen3_vl_train.py (a gradient element zero up to rounding then moves
# by lr times a sign set by the summation order).
OPTIONS = ("data.source=files", f"data.paths=[{DEMO_IMAGES}]", "data.read=global", "data.seq_len=1024",
           "optimizer.adam_eps=1e-6", SAVE_AT_END)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return layout_runs(tmp_path_factory.mktemp("internvl"), PRESET, *OPTIONS)


@pytest.mark.parametrize("layout", ["dp2", "tp2-pp2"])
def test_layout_trains_like_one_process(runs, layout):
    assert_layout_trains_like_one_process(runs, layout, REL, tensors=(
        ".vision_model.cls_token", ".vision_model.pos_embed", ".mlp.layer_scale", ".projector."))


def test_stored_embeddings_train_like_the_frozen_encoder(tmp_path):
    """`loongforge encode` stores the projector's features per tile token."""
    assert_stored_embeddings_train_like_the_frozen_encoder(tmp_path, PRESET, DEMO_IMAGES, "data.seq_len=1024")
