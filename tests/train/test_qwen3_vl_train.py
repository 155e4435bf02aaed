"""Qwen3-VL trains through the same command: DP 2 with balancing re-planning every step, and TP 2 x
PP 2, equal one process (losses, grad norms and Adam moments, DeepStack's mergers included, to 1e-5
relative) over 2 steps, and a copy of the DP 2 run cut back to step 1 and resumed ends bit-identical to it; stored embeddings (merger and
DeepStack features) train like the frozen online encoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.shared_data import SHARED_DATA
from tests.train.conftest import (
    SAVE_AT_END,
    assert_layout_trains_like_one_process,
    assert_stored_embeddings_train_like_the_frozen_encoder,
    checkpoint_differences,
    layout_runs,
    losses,
    resume_from_copy,
)

PRESET = "qwen3vl-tiny-small-vocab"
REL = 1e-5
# Adam's epsilon at 1e-6 (preset: 1e-8): with 1e-8, a gradient element that is zero up to rounding
# becomes a full +-lr step whose sign depends on the summation order, and the next steps carry that:
# TP 2 x PP 2 vs one process measured grad norms 2.7e-5 apart at step 4 and moments 4.7e-5. At 1e-6
# the same runs measure losses 3e-8, grad norms 2.5e-7, moments 2.7e-6, weights 3.7e-6.
# 4 decoder layers (SMALL_MODEL has 2): at PP 2 the first stage holds both DeepStack layers.
# 2 steps (the second after an update), resumed from step 1, as the other layout proofs (docs/testing.md).
OPTIONS = ("data.read=global", "optimizer.adam_eps=1e-6", "model.language.num_layers=4",
           "training.train_steps=2", "checkpoint.save_interval=1", SAVE_AT_END)
BALANCED = ("balance.enabled=true", "balance.threshold=0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return layout_runs(tmp_path_factory.mktemp("qwen3vl"), PRESET, *OPTIONS)


@pytest.mark.parametrize("layout", ["dp2", "tp2-pp2"])
def test_layout_trains_like_one_process(runs, layout):
    """DP 2 with balancing re-planning every step; TP 2 x PP 2 (DeepStack on the first stage): DeepStack's
    mergers and the learned positions train."""
    assert_layout_trains_like_one_process(runs, layout, REL, tensors=(".deepstack_projectors.",
                                                                      ".vision_model.pos_embed."))


def test_resume_is_exact(runs, tmp_path):
    resumed = tmp_path / "resumed"
    resume_from_copy(runs["dp2"], resumed, 1, *OPTIONS, *BALANCED, nproc=2, preset=PRESET)
    assert losses(resumed) == losses(runs["dp2"])
    assert max(checkpoint_differences(resumed, runs["dp2"]).values()) == 0.0


DEMO_IMAGES = SHARED_DATA / "llamafactory" / "mllm_demo.json"
MEDIA = ("data.seq_len=1024", "data.max_pixels=12544")


def test_stored_embeddings_with_deepstack_train_like_the_frozen_encoder(tmp_path):
    """`loongforge encode` stores per token the merger's features and each DeepStack level's; training
    on them equals training with the towers online and frozen (losses and grad norms at 1e-5)."""
    assert_stored_embeddings_train_like_the_frozen_encoder(tmp_path, PRESET, DEMO_IMAGES, *MEDIA)
    store = tmp_path / "embeddings"
    row = json.loads((store / "index.jsonl").read_text().splitlines()[0])
    with safe_open(str(store / row["shard"]), framework="pt") as shard:
        width = shard.get_tensor(row["key"]).shape[-1]
    assert width == 128 * 3  # LM hidden x (merger + 2 DeepStack levels)
