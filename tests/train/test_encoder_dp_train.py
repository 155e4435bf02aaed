"""``parallel.encoder_dp=tp`` end to end: ranks at TP 2 (vision TP 1) on the demo images and
videos train exactly like ``none``: per-step losses, grad norms, and every saved tensor (Adam's
moments, which sum every gradient of every step, and the weights) to 1e-5; also at TP 2 x DP 2 with
balancing moving samples between the DP ranks, and across a stop at step 2 and ``--resume``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongforge.convert.mcore_io import McoreReader
from tests.shared_data import SHARED_DATA
from tests.train.conftest import assert_close_relative, grad_norms, losses, run_train

RELATIVE = 1e-5
STEPS = 3
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


def _checkpoint_differences(a: Path, b: Path) -> dict[str, float]:
    """|a - b| / |b| (Frobenius) of every tensor of two checkpoints' final step."""
    readers = [McoreReader(sorted((run / "checkpoints").iterdir())[-1] / "model_optim") for run in (a, b)]
    assert set(readers[0].tensors) == set(readers[1].tensors)
    differences = {}
    for key in readers[1].tensors:
        x, y = (reader.read(key).double() for reader in readers)
        differences[key] = float((x - y).norm() / y.norm()) if y.norm() > 0 else float((x - y).norm())
    return differences


@pytest.fixture(scope="module")
def none_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("encoder_dp_none"), "none")


def _assert_trains_alike(tp_run: Path, none_run: Path) -> None:
    assert_close_relative(losses(tp_run), losses(none_run), RELATIVE)
    assert_close_relative(grad_norms(tp_run), grad_norms(none_run), RELATIVE)
    differences = _checkpoint_differences(tp_run, none_run)
    # Adam's moments are sums of every gradient (and its square) of every step: exact to 1e-5.
    moments = {k: v for k, v in differences.items() if k.startswith("optimizer.state.exp_avg")}
    assert any(key.startswith("optimizer.state.exp_avg.vision_model") for key in moments)
    worst = max(moments, key=moments.get)
    assert moments[worst] <= RELATIVE, (worst, moments[worst])
    # The weights: Adam's update m / sqrt(v) turns a gradient that is ~0 up to rounding into a
    # full step either way, so a weight that starts at 0 (biases) carries 1e-5-level differences.
    weights = {k: v for k, v in differences.items() if not k.startswith("optimizer.")}
    worst = max(weights, key=weights.get)
    assert weights[worst] <= 10 * RELATIVE, (worst, weights[worst])


def test_tp_trains_like_none(tmp_path, none_run):
    _assert_trains_alike(_train(tmp_path, "tp"), none_run)


def test_tp_trains_like_none_at_dp2_with_balancing(tmp_path):
    # Threshold 0: every step is re-planned and samples move between the two DP ranks.
    balanced = ("balance.enabled=true", "balance.threshold=0")
    none_run = _train(tmp_path / "none", "none", *balanced, nproc=4)
    tp_run = _train(tmp_path / "tp", "tp", *balanced, nproc=4)
    assert json.loads((tp_run / "summary.json").read_text())["balance"]["applied_steps"] == STEPS
    _assert_trains_alike(tp_run, none_run)


def test_tp_stopped_at_step_2_and_resumed(tmp_path, none_run):
    _train(tmp_path, "tp", "training.exit_at_step=2")
    assert len(losses(tmp_path)) == 2
    _train(tmp_path, "tp", resume=True)
    assert_close_relative(losses(tmp_path), losses(none_run), RELATIVE)
    assert_close_relative(grad_norms(tmp_path), grad_norms(none_run), RELATIVE)
