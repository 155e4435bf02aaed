"""balance.enabled re-assigns samples to ranks / micro-batches but must not change the math: the
loss is normalised by the global loss-token count, so on and off give the same losses."""

from __future__ import annotations

import json

import pytest

from tests.train.conftest import assert_close_relative, losses, run_train

BALANCE_ON = ("balance.enabled=true", "balance.threshold=0")


@pytest.fixture(scope="module")
def off(tmp_path_factory):
    """DP=2 without balancing (SMALL_MODEL: global batch 4 -> 2 micro-batches per rank)."""
    out = tmp_path_factory.mktemp("balance_off")
    run_train(out, nproc=2)
    return out


def test_balancing_does_not_change_losses_at_dp2(off, tmp_path):
    # Synthetic samples of varied lengths (text-only and image samples); threshold 0 re-plans
    # every step that has anything to gain.
    on = tmp_path / "on"
    proc = run_train(on, *BALANCE_ON, nproc=2)
    assert_close_relative(losses(on), losses(off), rel=1e-5)

    summary = json.loads((on / "summary.json").read_text())
    balance = summary["balance"]
    assert balance["applied_steps"] > 0, balance
    assert balance["applied_steps"] + balance["skipped_steps"] == 4
    assert balance["mean_max_over_lb_after"] < balance["mean_max_over_lb_before"]
    records = [json.loads(line) for line in (on / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["balance_applied"] for r in records) == balance["applied_steps"]
    assert all(r["balance_max_over_lb"] <= r["balance_max_over_lb_before"] for r in records)
    assert all(r["sync_wait_s"] >= 0 for r in records)  # measured imbalance at the gradient sync
    assert summary["mean_sync_wait_s"] >= 0 and "mean sync wait" in proc.stdout + proc.stderr
    assert json.loads((off / "summary.json").read_text())["balance"] is None
    assert "balance max/LB" in proc.stdout + proc.stderr and "steps applied" in proc.stdout + proc.stderr


def test_balanced_run_resumes_exactly(off, tmp_path):
    # The data state carries the cost model the plans used, so a resumed run re-makes the same plans.
    run_train(tmp_path, *BALANCE_ON, "training.exit_at_step=2", nproc=2)
    run_train(tmp_path, *BALANCE_ON, nproc=2, resume=True)
    assert_close_relative(losses(tmp_path), losses(off), rel=1e-5)


def test_exchange_mode_keeps_losses_and_resumes_exactly(tmp_path):
    # data.read=sharded: each rank loads its own half of the samples, so balancing gathers sizes
    # and moves samples between the ranks (exchange mode) in the data thread.
    sharded = ("data.read=sharded", "data.synthetic_num_samples=400")
    off = tmp_path / "off"
    run_train(off, *sharded, nproc=2)
    on = tmp_path / "on"
    first = run_train(on, *sharded, *BALANCE_ON, "training.exit_at_step=2", nproc=2)
    run_train(on, *sharded, *BALANCE_ON, nproc=2, resume=True)
    assert "balance: exchange mode (data.read=sharded)" in first.stdout + first.stderr
    assert_close_relative(losses(on), losses(off), rel=1e-5)
    records = [json.loads(line) for line in (on / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and sum(r["balance_applied"] for r in records) > 0
