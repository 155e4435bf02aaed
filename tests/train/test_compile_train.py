"""``training.compile=on`` trains as eager does: the small model's losses and grad norms, 4 steps on the CPU, equal
the baseline run's (``training.compile: auto``, off on the CPU) with norms, RoPE and SwiGLU compiled."""

from __future__ import annotations

from tests.train.conftest import assert_close_relative, grad_norms, losses, run_train

# Measured 0 (losses) and 7.4e-8 (grad norms) apart; fp32 reductions in another order may move the last bits.
RELATIVE = 1e-6


def test_compiled_run_trains_like_eager(baseline_run, tmp_path):
    proc = run_train(tmp_path, "checkpoint.save_interval=2", "training.compile=on")
    assert "compile: on: torch.compile of norm, rope, swiglu, permute" in proc.stdout
    assert "compile: auto: eager" in baseline_run.with_suffix(".stdout").read_text()
    assert_close_relative(losses(tmp_path), losses(baseline_run), RELATIVE, "training.compile=on vs off, losses")
    assert_close_relative(grad_norms(tmp_path), grad_norms(baseline_run), RELATIVE,
                          "training.compile=on vs off, grad norms")
