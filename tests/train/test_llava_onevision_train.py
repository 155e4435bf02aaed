"""LLaVA-OneVision (SigLIP + MLP + anyres packing + Qwen2, 1-D RoPE) trains through the same command on the
demo photos (one image a sample: its base square and anyres crops, packed by its size; two: a padded
square each): DP 2 with balancing re-planning every step, and TP 2 x PP 2 (vision TP 2), equal one
process (losses, grad norms and Adam moments, the newline and the projector included, to 1e-5
relative); stored embeddings (``loongforge encode``: each image's packed features) train like the frozen
online encoder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.shared_data import SHARED_DATA
from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    checkpoint_differences,
    grad_norms,
    losses,
    run_train,
    worst_relative,
)

PRESET = "llava-onevision-tiny-small-vocab"
REL = 1e-5
DEMO_IMAGES = SHARED_DATA / "llamafactory" / "mllm_demo.json"
# Adam's epsilon at 1e-6 as in tests/train/test_qwen3_vl_train.py (a gradient element zero up to rounding
# then moves by lr times a sign set by the summation order).
OPTIONS = ("data.source=files", f"data.paths=[{DEMO_IMAGES}]", "data.read=global", "data.seq_len=1024",
           "optimizer.adam_eps=1e-6", SAVE_AT_END)
BALANCED = ("balance.enabled=true", "balance.threshold=0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava_onevision")
    launches = (("dp1", (), 1), ("dp2", BALANCED, 2),
                ("tp2-pp2", ("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"), 4))
    for name, extra, nproc in launches:
        run_train(root / name, *OPTIONS, *extra, nproc=nproc, preset=PRESET)
    return {name: root / name for name, _, _ in launches}


@pytest.mark.parametrize("layout", ["dp2", "tp2-pp2"])
def test_layout_trains_like_one_process(runs, layout):
    reference = "dp1"
    assert losses(runs[reference])[-1] < losses(runs[reference])[0]
    assert_close_relative(losses(runs[layout]), losses(runs[reference]), REL)
    assert_close_relative(grad_norms(runs[layout]), grad_norms(runs[reference]), REL)
    moments = {k: v for k, v in checkpoint_differences(runs[layout], runs[reference]).items()
               if k.startswith("optimizer.state.exp_avg")}
    for tensor in (".vision_model.pos_embed", ".image_newline", ".projector."):
        assert any(tensor in key for key in moments), tensor  # every kind of the tower's tensors trains
    worst = max(moments, key=moments.get)
    assert moments[worst] <= REL, (worst, moments[worst])
    print(f"\n{layout} vs one process: losses {worst_relative(losses(runs[layout]), losses(runs[reference])):.1e}, "
          f"grad norms {worst_relative(grad_norms(runs[layout]), grad_norms(runs[reference])):.1e}, "
          f"Adam moments {moments[worst]:.1e} ({worst})")


STORED_RUN = ("data.source=files", f"data.paths=[{DEMO_IMAGES}]", "data.seq_len=1024", "training.train_steps=4",
              "training.global_batch_size=2")


def test_stored_embeddings_train_like_the_frozen_encoder(tmp_path):
    """`loongforge encode` stores each image's packed features (its anyres canvas with the newline, or a
    padded square's and the newline where a sample holds several images); training on them equals
    training with SigLIP, the projector and the newline online and frozen (losses and grad norms at 1e-5)."""
    store = tmp_path / "embeddings"
    proc = subprocess.run([sys.executable, "-m", "loongforge.cli.app", "encode", str(DEMO_IMAGES), "--output",
                           str(store), "--preset", PRESET, "--dtype", "fp32", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_train(tmp_path / "online", *STORED_RUN, "training.freeze_vision=true", "training.freeze_projector=true",
              preset=PRESET)
    run_train(tmp_path / "stored", *STORED_RUN, f"data.vision_embeddings={store}", preset=PRESET)
    assert_close_relative(losses(tmp_path / "stored"), losses(tmp_path / "online"), REL)
    assert_close_relative(grad_norms(tmp_path / "stored"), grad_norms(tmp_path / "online"), REL)
    print(f"\nstored vs online frozen: losses {worst_relative(losses(tmp_path / 'stored'), losses(tmp_path / 'online')):.1e}, "
          f"grad norms {worst_relative(grad_norms(tmp_path / 'stored'), grad_norms(tmp_path / 'online')):.1e}")
