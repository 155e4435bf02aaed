"""StepBalancer (metadata-mode balancing): every sample kept once, capacities, threshold, determinism."""

from dataclasses import dataclass, field

import numpy as np
import pytest

from loongforge.balance.apply import BalanceCounters, SampleSize, StepBalancer, sample_patches
from loongforge.balance.cost_model import TERMS, CostModel


@dataclass
class FakeSample:  # the MeasuredSample fields the balancer reads
    length: int
    image_grids: list = field(default_factory=list)
    video_plans: list = field(default_factory=list)
    loss_tokens: int = 0


def _rows(lengths_per_row):
    return [[FakeSample(n) for n in row] for row in lengths_per_row]


def _balancer(**kw):
    args = dict(dp_size=2, micro_batches=2, seq_len=100, threshold=0.0, objective="sum")
    args.update(kw)
    return StepBalancer(**args)


def _check_partition(decision, rows, *, dp, m, seq_len):
    samples = [s for row in rows for s in row]
    flat = sorted(i for rank in decision.micro_batches for mb in rank for i in mb)
    assert flat == list(range(len(samples)))  # every sample exactly once
    assert len(decision.micro_batches) == dp
    for rank in decision.micro_batches:
        assert len(rank) == m and all(rank)  # equal micro-batch counts, none empty
        for mb in rank:
            assert sum(samples[i].length for i in mb) <= seq_len


def test_unbalanced_step_is_replanned_and_keeps_every_sample():
    # Rank 0 gets two full rows, rank 1 two nearly empty ones.
    rows = _rows([[50, 45], [60, 30, 5], [10, 5], [8, 2, 1]])
    decision = _balancer().decide(rows)
    assert decision.applied and decision.after < decision.before
    assert decision.after == pytest.approx(1.0, abs=0.02)
    _check_partition(decision, rows, dp=2, m=2, seq_len=100)


def test_threshold_skips_balanced_steps():
    rows = _rows([[50, 40], [45, 45], [40, 50], [45, 45]])
    decision = _balancer(threshold=0.01).decide(rows)
    assert not decision.applied and decision.reason == "below threshold"
    assert decision.micro_batches == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # arrival order
    assert decision.before == decision.after


def test_slots_objective_and_vision_costs():
    model = CostModel({t: 0.0 for t in TERMS} | {"sum_L": 1.0, "sum_P": 1.0})
    rows = _rows([[20, 20], [20, 20], [20, 20], [20, 20]])
    rows[0][0].image_grids = [(1, 8, 8)]  # 64 patches: the costliest sample by far
    rows[1][0].image_grids = [(1, 8, 8)]
    assert sample_patches(rows[0][0]) == [64]
    decision = _balancer(objective="slots", cost_model=model).decide(rows)
    assert decision.applied
    _check_partition(decision, rows, dp=2, m=2, seq_len=100)
    samples = [s for row in rows for s in row]
    ranks_with_images = {r for r, rank in enumerate(decision.micro_batches)
                         for mb in rank for i in mb if samples[i].image_grids}
    assert ranks_with_images == {0, 1}


def test_too_few_samples_for_the_micro_batches_keeps_arrival():
    # One giant sample: a rank that holds it alone could not fill two micro-batches.
    rows = _rows([[95], [5], [5], [5]])
    decision = _balancer().decide(rows)
    _check_partition(decision, rows, dp=2, m=2, seq_len=100)
    assert not decision.applied


def test_deterministic_and_counters():
    rng = np.random.default_rng(0)
    rows = [[FakeSample(int(n)) for n in rng.integers(5, 40, size=rng.integers(1, 5))] for _ in range(16)]
    a = _balancer(dp_size=4, micro_batches=4, seq_len=160).decide(rows)
    b = _balancer(dp_size=4, micro_batches=4, seq_len=160).decide(rows)
    assert a.micro_batches == b.micro_batches
    _check_partition(a, rows, dp=4, m=4, seq_len=160)
    counters = BalanceCounters()
    counters.add(a)
    counters.add(_balancer(threshold=10.0).decide(_rows([[50, 40], [45, 45], [40, 50], [45, 45]])))
    out = counters.as_dict()
    assert out["applied_steps"] + out["skipped_steps"] == 2 and out["skipped_steps"] >= 1


@pytest.mark.parametrize("value", ["-0.5", "nan"])
def test_bad_threshold_is_a_config_error(tmp_path, value):
    from loongforge.config.errors import ConfigError
    from loongforge.config.loader import load_run_config

    config = tmp_path / "run.yaml"
    config.write_text(f"balance:\n  enabled: true\n  threshold: {'.nan' if value == 'nan' else value}\n")
    with pytest.raises(ConfigError, match="balance.threshold"):
        load_run_config("qwen2.5vl-tiny", config_file=config)


def test_threshold_defaults():
    from loongforge.config.schema import BalanceConfig

    assert BalanceConfig().enabled is False and BalanceConfig().threshold == 0.01


def test_balancer_uses_the_polished_arrival_when_it_beats_a_fresh_plan():
    from tests.balance.test_planner import TIGHT_COSTS, TIGHT_TOKENS

    # Price samples by their loss tokens only, so the costs above are reproduced exactly.
    model = CostModel({t: 0.0 for t in TERMS} | {"n_loss": 1.0})
    sizes = [SampleSize(int(t), (), int(round(c * 100))) for t, c in zip(TIGHT_TOKENS, TIGHT_COSTS)]
    rows = [sizes[0:3], sizes[3:6], sizes[6:10], sizes[10:13]]
    decision = _balancer(seq_len=4096, cost_model=model).decide(rows)
    # docs/benchmarks/train_balance.md: the polished arrival order "reach[es] 1.002 on that step".
    assert decision.applied and decision.before > 1.08 and decision.after <= 1.002
    _check_partition(decision, rows, dp=2, m=2, seq_len=4096)


def test_whole_rows_are_dealt_and_never_repacked():
    """A model with a statistic of each row (an MoE's load-balancing loss) keeps the step's rows as they arrived:
    each micro-batch one whole row, the ranks balanced by which rows they take."""
    rows = _rows([[90], [30, 20], [80, 10], [40]])  # arrival: rank 0 rows 0 and 1 (140), rank 1 rows 2 and 3 (130)
    skewed = _rows([[90], [80, 10], [30, 20], [40]])  # rank 0 takes the two dearest rows (180), rank 1 90
    balancer = _balancer(whole_rows=True)
    decision = balancer.decide(skewed)
    _check_partition(decision, skewed, dp=2, m=2, seq_len=100)
    samples_of_row = [[0], [1, 2], [3, 4], [5]]
    trained = sorted(mb for rank in decision.micro_batches for mb in rank)
    assert trained == samples_of_row  # every row whole, none merged or split
    lengths = [s.length for row in skewed for s in row]
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in decision.micro_batches]
    print(f"\nwhole rows: max/LB {decision.before:.3f} -> {decision.after:.3f}, rank loads {loads}")
    assert decision.applied and sorted(loads) == [130, 140] and decision.after < decision.before
    # Repacking samples would balance these better; whole rows forbid it.
    assert _balancer().decide(skewed).micro_batches != decision.micro_batches
    # Already balanced by whole rows: kept as it arrived.
    assert not balancer.decide(rows).applied
