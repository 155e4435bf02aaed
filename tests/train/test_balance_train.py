"""balance.enabled re-assigns samples to ranks / micro-batches but must not change the math: the
loss is normalised by the global loss-token count, so on and off give the same losses. A resumed
balanced run re-makes the uninterrupted run's plans and hands every rank the same samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    cut_back_copy,
    losses,
    run_recorded,
    run_train,
)

BALANCE_ON = ("balance.enabled=true", "balance.threshold=0")
SAVES = ("checkpoint.save_interval=2", SAVE_AT_END)
NPROC = 2


def _flat(per_rank: list[list[list[str]]]) -> list[str]:
    return [sid for micro_batches in per_rank for mb in micro_batches for sid in mb]


def plan_records(out_dir: Path) -> list[list[dict]]:
    """Per rank, the recorded steps in order."""
    return [[json.loads(line) for line in (out_dir / f"plans_rank{rank}.jsonl").read_text().splitlines()]
            for rank in range(NPROC)]


@pytest.fixture(scope="module")
def off(tmp_path_factory):
    """DP=2 without balancing (SMALL_MODEL: global batch 4 -> 2 micro-batches per rank), sample
    ids recorded per rank."""
    out = tmp_path_factory.mktemp("balance_off")
    run_recorded(out, nproc=NPROC)
    return out


@pytest.fixture(scope="module")
def on(tmp_path_factory):
    """The same with balancing, uninterrupted, plans and sample ids recorded per rank. Synthetic
    samples of varied lengths (text-only and image samples); threshold 0 re-plans every step that
    has anything to gain. Checkpoints at steps 2 and 4, for a resumed copy."""
    out = tmp_path_factory.mktemp("balance_on")
    (out / "rank0_output.txt").write_text(run_recorded(out, *BALANCE_ON, *SAVES, nproc=NPROC))
    return out


def test_balancing_moves_samples_but_not_the_losses_at_dp2(off, on):
    assert_close_relative(losses(on), losses(off), rel=1e-5)
    # Each step trains the same samples over both ranks, placed differently in some step.
    balanced, plain = plan_records(on), plan_records(off)
    moved = 0
    for step in range(4):
        on_ids = [balanced[r][step]["sample_ids"] for r in range(NPROC)]
        off_ids = [plain[r][step]["sample_ids"] for r in range(NPROC)]
        assert sorted(_flat(on_ids)) == sorted(_flat(off_ids)), step
        moved += on_ids != off_ids
    assert moved > 0

    summary = json.loads((on / "summary.json").read_text())
    balance = summary["balance"]
    assert balance["applied_steps"] > 0, balance
    assert balance["applied_steps"] + balance["skipped_steps"] == 4
    assert balance["mean_max_over_lb_after"] < balance["mean_max_over_lb_before"]
    records = [json.loads(line) for line in (on / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["balance_applied"] for r in records) == balance["applied_steps"]
    assert all(r["balance_max_over_lb"] <= r["balance_max_over_lb_before"] for r in records)
    # Measured imbalance at the gradient sync: the spread of two ranks' measured times (never
    # exactly equal), and the summary's mean is the mean of the logged steps.
    waits = [r["sync_wait_s"] for r in records]
    assert all(w is not None and w > 0 for w in waits), waits
    assert summary["mean_sync_wait_s"] == pytest.approx(sum(waits) / len(waits))
    assert json.loads((off / "summary.json").read_text())["balance"] is None
    # The plans the recorder saw are the plans the counters counted.
    assert sum(r["applied"] for r in plan_records(on)[0]) == balance["applied_steps"]
    text = (on / "rank0_output.txt").read_text()
    assert "balance max/LB" in text and "steps applied" in text and "mean sync wait" in text


def test_balanced_run_resumes_with_the_same_plans_and_samples(on, tmp_path):
    # The data state carries the cost model the plans used, so a resumed run re-makes the same
    # plans: every rank gets the same samples in the same micro-batches at every step. A copy of
    # the uninterrupted run cut back to step 2, its plan records too, is resumed.
    out = cut_back_copy(on, tmp_path / "resumed", 2)
    for rank, records in enumerate(plan_records(out)):
        (out / f"plans_rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    assert [r["step"] for r in plan_records(out)[0]] == [1, 2]
    output = run_recorded(out, *BALANCE_ON, *SAVES, nproc=NPROC, resume=True)
    assert "resumed from" in output and "at step 2" in output, output[-3000:]
    resumed, uninterrupted = plan_records(out), plan_records(on)
    for rank in range(NPROC):
        assert [r["step"] for r in resumed[rank]] == [1, 2, 3, 4]
        assert resumed[rank] == uninterrupted[rank], f"rank {rank}"
    # Both ranks hold the same plan, and the steps after the resume were re-planned (not the
    # arrival order), so equal plans are evidence, not a default.
    assert [r["plan"] for r in resumed[0]] == [r["plan"] for r in resumed[1]]
    assert any(r["applied"] for r in resumed[0][2:]), resumed[0]
    assert losses(out) == losses(on)


def test_exchange_mode_keeps_losses_and_resumes_exactly(tmp_path):
    # data.read=sharded: each rank loads its own half of the samples, so balancing gathers sizes
    # and moves samples between the ranks (exchange mode) in the data thread. seq_len 192: rows of
    # about three samples (half SMALL_MODEL's 384), enough for balancing to move some.
    sharded = ("data.read=sharded", "data.synthetic_num_samples=400", "data.seq_len=192")
    off = tmp_path / "off"
    run_train(off, *sharded, nproc=2)
    on = tmp_path / "on"
    first = run_train(on, *sharded, *BALANCE_ON, "training.exit_at_step=2", SAVE_AT_END, nproc=2)
    run_train(on, *sharded, *BALANCE_ON, nproc=2, resume=True)
    assert "balance: exchange mode (data.read=sharded)" in first.stdout + first.stderr
    assert_close_relative(losses(on), losses(off), rel=1e-5)
    records = [json.loads(line) for line in (on / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and sum(r["balance_applied"] for r in records) > 0
