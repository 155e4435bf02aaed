"""balance.enabled re-assigns samples to ranks / micro-batches but must not change the math: the
loss is normalised by the global loss-token count, so on and off give the same losses."""

from __future__ import annotations

import json

from tests.train.conftest import assert_close_relative, losses, run_train


def test_balancing_does_not_change_losses_at_dp2(tmp_path):
    # SMALL_MODEL: global batch 4 at DP=2 -> 2 micro-batches per rank; synthetic samples of varied
    # lengths (text-only and image samples); threshold 0 re-plans every step that has anything to gain.
    off, on = tmp_path / "off", tmp_path / "on"
    run_train(off, nproc=2)
    run_train(on, "balance.enabled=true", "balance.threshold=0", nproc=2)
    assert_close_relative(losses(on), losses(off), rel=1e-5)

    summary = json.loads((on / "summary.json").read_text())
    balance = summary["balance"]
    assert balance["applied_steps"] > 0, balance
    assert balance["applied_steps"] + balance["skipped_steps"] == 4
    assert balance["mean_max_over_lb_after"] < balance["mean_max_over_lb_before"]
    records = [json.loads(line) for line in (on / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["balance_applied"] for r in records) == balance["applied_steps"]
    assert all(r["balance_max_over_lb"] <= r["balance_max_over_lb_before"] for r in records)
    assert json.loads((off / "summary.json").read_text())["balance"] is None
