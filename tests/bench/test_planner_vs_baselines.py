"""The planner against the bench's baselines and step sampler (which live in ``loongforge.bench``)."""

import numpy as np

from loongforge.balance.planner import DEFAULT_TOLERANCE, plan_step
from loongforge.bench.baselines import plan_none
from loongforge.bench.simulate import StepSampler
from tests.balance.test_planner import _check_valid, _long_tail


def test_beats_arrival_order_packing():
    costs, tokens = _long_tail(1000, seed=3)
    dp, ga, seq_len = 16, 4, 16384
    ours = plan_step(costs, tokens, dp_size=dp, micro_batches=ga, seq_len=seq_len)
    arrival = plan_none(costs, tokens, dp_size=dp, micro_batches=ga, seq_len=seq_len)
    assert ours.stats["step_cost"] < arrival.stats["step_cost"]
    assert ours.stats["max_over_lb"] <= 1 + DEFAULT_TOLERANCE + 1e-9


def test_tightly_packed_step_falls_back_to_a_feasible_packing():
    # A step packed next-fit to ~90% of 8 micro-batches of 8192 tokens (as the pipeline packs rows),
    # where cost-first placement runs out of room: the plan starts from the arrival packing instead.
    rng = np.random.default_rng(3)
    tokens = rng.integers(50, 3000, 600) + 256 * rng.integers(0, 6, 600)
    costs = tokens * 1e-4 + rng.uniform(0, 0.3, 600)
    chosen = StepSampler(tokens, 8192, 3).draw(8)
    plan = plan_step(costs[chosen], tokens[chosen], dp_size=4, micro_batches=2, seq_len=8192)
    assert plan.stats["fallback"]
    _check_valid(plan, chosen.size, 4, 2, 8192, tokens[chosen])
    assert plan.stats["max_over_lb"] <= 1.01
