"""``parallel.encoder_dp=tp`` end to end: ranks at TP 2 (vision TP 1) on the demo images and
videos train exactly like ``none``: per-step losses, grad norms, and every saved tensor (Adam's
moments, which sum every gradient of every step, and the weights) to 1e-5 over 5 steps; also at TP 2 x DP 2 with
balancing moving samples between the DP ranks, and across a stop at step 2 and ``--resume``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.shared_data import SHARED_DATA
from tests.train.conftest import assert_close_relative, assert_trains_alike, grad_norms, losses, run_train

RELATIVE = 1e-5
STEPS = 5
DEMO = SHARED_DATA / "llamafactory"
TP2_ON_DEMO_MEDIA = (
    "data.source=files", f"data.paths=[{DEMO / 'mllm_demo.json'},{DEMO / 'mllm_video_demo.json'}]",
    "data.seq_len=1024", "data.video_max_frames=4", "data.video_min_pixels=3136",
    "data.video_max_pixels=12544", f"training.train_steps={STEPS}",
    "parallel.tensor_model_parallel_size=2", "parallel.vision_tensor_model_parallel_size=1",
)

pytestmark = pytest.mark.skipif(not DEMO.is_dir(), reason=f"needs the shared demo data ({DEMO})")


def _train(out: Path, mode: str, *extra: str, nproc: int = 2, resume: bool = False) -> Path:
    run_train(out, *TP2_ON_DEMO_MEDIA, f"parallel.encoder_dp={mode}", *extra, nproc=nproc, resume=resume)
    return out


@pytest.fixture(scope="module")
def none_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("encoder_dp_none"), "none")


def test_tp_trains_like_none(tmp_path, none_run):
    assert_trains_alike(_train(tmp_path, "tp"), none_run)


def test_tp_trains_like_none_at_dp2_with_balancing(tmp_path):
    # Threshold 0: every step is re-planned and samples move between the two DP ranks.
    # seq_len 512: rows of five to seven samples, images and videos among them (at 256 the language
    # qkv bias, which starts at 0, ends 8.8e-5 apart against the 1e-4 bound; at 512, 6.6e-5).
    balanced = ("data.seq_len=512", "balance.enabled=true", "balance.threshold=0")
    none_run = _train(tmp_path / "none", "none", *balanced, nproc=4)
    tp_run = _train(tmp_path / "tp", "tp", *balanced, nproc=4)
    # Re-planned wherever a plan was not already even: samples moved between the DP ranks.
    assert json.loads((tp_run / "summary.json").read_text())["balance"]["applied_steps"] >= STEPS - 1
    assert_trains_alike(tp_run, none_run)


def test_tp_stopped_at_step_2_and_resumed(tmp_path, none_run):
    _train(tmp_path, "tp", "training.exit_at_step=2")
    assert len(losses(tmp_path)) == 2
    _train(tmp_path, "tp", resume=True)
    assert_close_relative(losses(tmp_path), losses(none_run), RELATIVE)
    assert_close_relative(grad_norms(tmp_path), grad_norms(none_run), RELATIVE)
