"""Qwen3-VL trains through the same command: DP 2 with balancing re-planning every step, and TP 2 x
PP 2, equal one process (losses, grad norms and Adam moments, DeepStack's mergers included, to 1e-5
relative), and a copy of the DP 2 run cut back to step 2 and resumed ends bit-identical to it; stored embeddings (merger and
DeepStack features) train like the frozen online encoder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.shared_data import SHARED_DATA
from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    checkpoint_differences,
    grad_norms,
    losses,
    resume_from_copy,
    run_train,
)

PRESET = "qwen3vl-tiny-small-vocab"
REL = 1e-5
# Adam's epsilon at 1e-6 (preset: 1e-8): with 1e-8, a gradient element that is zero up to rounding
# becomes a full +-lr step whose sign depends on the summation order, and the next steps carry that:
# TP 2 x PP 2 vs one process measured grad norms 2.7e-5 apart at step 4 and moments 4.7e-5. At 1e-6
# the same runs measure losses 3e-8, grad norms 2.5e-7, moments 2.7e-6, weights 3.7e-6.
# 4 decoder layers (SMALL_MODEL has 2): at PP 2 the first stage holds both DeepStack layers.
OPTIONS = ("data.read=global", "optimizer.adam_eps=1e-6", "model.language.num_layers=4",
           "checkpoint.save_interval=2", SAVE_AT_END)
BALANCED = ("balance.enabled=true", "balance.threshold=0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3vl")
    launches = (("dp1", (), 1), ("dp2", BALANCED, 2),
                ("tp2-pp2", ("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"), 4))
    for name, extra, nproc in launches:
        run_train(root / name, *OPTIONS, *extra, nproc=nproc, preset=PRESET)
    return {name: root / name for name, _, _ in launches}


@pytest.mark.parametrize("layout", ["dp2", "tp2-pp2"])
def test_layout_trains_like_one_process(runs, layout):
    """DP 2 with balancing re-planning every step; TP 2 x PP 2 (DeepStack on the first stage)."""
    reference = "dp1"
    assert losses(runs[reference])[-1] < losses(runs[reference])[0]
    assert_close_relative(losses(runs[layout]), losses(runs[reference]), REL)
    assert_close_relative(grad_norms(runs[layout]), grad_norms(runs[reference]), REL)
    moments = {k: v for k, v in checkpoint_differences(runs[layout], runs[reference]).items()
               if k.startswith("optimizer.state.exp_avg")}
    assert any(".deepstack_projectors." in key for key in moments)  # DeepStack's mergers train
    assert any(".vision_model.pos_embed." in key for key in moments)  # the learned positions train
    worst = max(moments, key=moments.get)
    assert moments[worst] <= REL, (worst, moments[worst])


def test_resume_is_exact(runs, tmp_path):
    resumed = tmp_path / "resumed"
    resume_from_copy(runs["dp2"], resumed, 2, *OPTIONS, *BALANCED, nproc=2, preset=PRESET)
    assert losses(resumed) == losses(runs["dp2"])
    assert max(checkpoint_differences(resumed, runs["dp2"]).values()) == 0.0


DEMO_IMAGES = SHARED_DATA / "llamafactory" / "mllm_demo.json"
MEDIA = ("data.seq_len=1024", "data.max_pixels=12544")
STORED_RUN = ("data.source=files", f"data.paths=[{DEMO_IMAGES}]", *MEDIA, "training.train_steps=4",
              "training.global_batch_size=2")


def test_stored_embeddings_with_deepstack_train_like_the_frozen_encoder(tmp_path):
    """`loongforge encode` stores per token the merger's features and each DeepStack level's; training
    on them equals training with the towers online and frozen (losses and grad norms at 1e-5)."""
    store = tmp_path / "embeddings"
    sets = [arg for setting in MEDIA for arg in ("--set", setting)]
    proc = subprocess.run([sys.executable, "-m", "loongforge.cli.app", "encode", str(DEMO_IMAGES), "--output",
                           str(store), "--preset", PRESET, "--dtype", "fp32", "--no-progress", *sets],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads((store / "index.jsonl").read_text().splitlines()[0])
    with safe_open(str(store / row["shard"]), framework="pt") as shard:
        width = shard.get_tensor(row["key"]).shape[-1]
    assert width == 128 * 3  # LM hidden x (merger + 2 DeepStack levels)
    run_train(tmp_path / "online", *STORED_RUN, "training.freeze_vision=true", "training.freeze_projector=true",
              preset=PRESET)
    run_train(tmp_path / "stored", *STORED_RUN, f"data.vision_embeddings={store}", preset=PRESET)
    assert_close_relative(losses(tmp_path / "stored"), losses(tmp_path / "online"), REL)
    assert_close_relative(grad_norms(tmp_path / "stored"), grad_norms(tmp_path / "online"), REL)
