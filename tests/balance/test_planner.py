"""The step planner: validity (every sample once, capacity, equal micro-batch counts),
determinism, and closeness to the lower bound on adversarial inputs."""

import hashlib
import subprocess
import sys
import time

import numpy as np
import pytest

from loongforge.balance.planner import PlanError, lower_bound, plan_step, step_cost

# The planner refines until the slowest rank is within 0.2% (DEFAULT_TOLERANCE) of the lower bound
# (module docstring; docs/benchmarks/balance.md measures worst 1.0016 at GA=4): on steps with room
# that is where every plan here ends. A step packed so tightly that samples can barely move may stop
# above it; the documented target for those is max/LB <= 1.01 (balance.md, worst 1.0067).
NEAR_LB = 1.002 + 1e-9
TIGHT_LB = 1.01


def _long_tail(n, seed, max_tokens=4096):
    rng = np.random.default_rng(seed)
    tokens = np.clip(rng.lognormal(np.log(600), 0.9, n), 16, max_tokens).astype(np.int64)
    # Cost: linear + attention + an image on half of the samples.
    images = np.where(rng.random(n) < 0.5, rng.integers(256, 4096, n), 0)
    costs = 1e-4 * tokens + 1.5e-9 * tokens.astype(float) ** 2 + 1e-5 * images
    return costs, tokens


def _check_valid(plan, n, dp, ga, seq_len, tokens):
    assert len(plan.micro_batches) == dp
    assert all(len(rank) == ga for rank in plan.micro_batches)
    flat = sorted(i for rank in plan.micro_batches for mb in rank for i in mb)
    assert flat == list(range(n)), "every sample exactly once"
    for r, rank in enumerate(plan.micro_batches):
        for m, mb in enumerate(rank):
            assert int(tokens[mb].sum()) <= seq_len
            assert int(tokens[mb].sum()) == plan.slot_tokens[r, m]
            assert all(plan.rank_of[i] == r and plan.micro_batch_of[i] == m for i in mb)


@pytest.mark.parametrize("dp,ga,objective", [(1, 1, "sum"), (4, 1, "sum"), (8, 4, "sum"),
                                             (32, 2, "sum"), (8, 4, "slots"), (16, 3, "slots")])
def test_plan_is_valid_and_near_the_lower_bound(dp, ga, objective):
    seq_len = 16384
    costs, tokens = _long_tail(dp * ga * 8, seed=dp * 10 + ga)
    plan = plan_step(costs, tokens, dp_size=dp, micro_batches=ga, seq_len=seq_len, objective=objective)
    _check_valid(plan, len(costs), dp, ga, seq_len, tokens)
    assert plan.stats["max_over_lb"] <= NEAR_LB
    assert plan.step_cost() == pytest.approx(plan.stats["step_cost"])
    assert plan.lower_bound == pytest.approx(lower_bound(costs, dp))


def test_slots_objective_balances_every_slot():
    costs, tokens = _long_tail(500, seed=5)
    dp, ga = 8, 4
    slots = plan_step(costs, tokens, dp_size=dp, micro_batches=ga, seq_len=16384, objective="slots")
    summed = plan_step(costs, tokens, dp_size=dp, micro_batches=ga, seq_len=16384, objective="sum")
    # The slot objective is what pipeline parallelism pays; its own plan should not be worse.
    assert step_cost(slots.slot_costs, "slots") <= step_cost(summed.slot_costs, "slots") + 1e-12
    assert slots.stats["max_over_lb"] <= NEAR_LB


def test_one_giant_sample_gets_a_rank_to_itself():
    costs = np.array([100.0] + [1.0] * 99)
    tokens = np.array([1000] + [10] * 99)
    plan = plan_step(costs, tokens, dp_size=4, micro_batches=2, seq_len=1000)
    assert plan.lower_bound == 100.0
    assert plan.stats["max_over_lb"] == pytest.approx(1.0)
    giant_rank = plan.rank_of[0]
    assert plan.samples_of(giant_rank) == [0]


def test_all_equal_samples_split_exactly():
    costs, tokens = np.full(96, 2.5), np.full(96, 100)
    plan = plan_step(costs, tokens, dp_size=8, micro_batches=3, seq_len=400)
    assert plan.stats["max_over_lb"] == pytest.approx(1.0)
    assert (plan.slot_tokens == 400).all()  # 4 samples per micro-batch


def test_two_sizes_reach_the_perfect_split():
    # 4 samples of 3 and 12 of 2 over 4 ranks: only 3+2+2+2 = 9 on every rank is optimal.
    costs = np.array([3.0] * 4 + [2.0] * 12)
    tokens = np.full(16, 10)
    plan = plan_step(costs, tokens, dp_size=4, micro_batches=1, seq_len=100)
    assert plan.rank_costs.tolist() == [9.0] * 4


def test_two_sizes_needing_refinement():
    # 5, 5, 4, 3, 3 over 2 ranks: greedy gives 5+3+3=11 vs 5+4=9 (or similar); optimum 10 = 5+5 | 4+3+3.
    costs = np.array([5.0, 5.0, 4.0, 3.0, 3.0])
    plan = plan_step(costs, np.full(5, 1), dp_size=2, micro_batches=1, seq_len=10, tolerance=0.0)
    assert sorted(plan.rank_costs.tolist()) == [10.0, 10.0]


def test_capacity_binds_and_is_respected():
    # Cheap long samples and expensive short ones: balancing by cost alone would overfill ranks.
    rng = np.random.default_rng(0)
    tokens = np.concatenate([np.full(16, 900), np.full(30, 50)])  # 15,900 of 16,000 tokens
    costs = np.concatenate([np.full(16, 0.1), rng.uniform(0.5, 1.0, 30)])
    dp, ga, seq_len = 4, 4, 1000
    assert tokens.sum() <= dp * ga * seq_len
    plan = plan_step(costs, tokens, dp_size=dp, micro_batches=ga, seq_len=seq_len)
    _check_valid(plan, len(costs), dp, ga, seq_len, tokens)


def test_step_that_cannot_fit_says_what_to_change():
    with pytest.raises(PlanError, match=r"dp_size \* micro_batches \* seq_len.*raise seq_len"):
        plan_step(np.ones(10), np.full(10, 100), dp_size=2, micro_batches=2, seq_len=200)
    with pytest.raises(PlanError, match="sample 3 has 300 tokens > seq_len=200"):
        plan_step(np.ones(5), [10, 10, 10, 300, 10], dp_size=2, micro_batches=2, seq_len=200)
    with pytest.raises(PlanError, match="objective"):
        plan_step(np.ones(2), [1, 1], dp_size=1, micro_batches=1, seq_len=10, objective="max")
    with pytest.raises(PlanError, match="finite"):
        plan_step([1.0, np.nan], [1, 1], dp_size=1, micro_batches=1, seq_len=10)


def test_empty_step_and_fewer_samples_than_micro_batches():
    plan = plan_step([], [], dp_size=2, micro_batches=2, seq_len=10)
    assert plan.micro_batches == [[[], []], [[], []]]
    plan = plan_step([1.0, 2.0, 3.0], [1, 1, 1], dp_size=4, micro_batches=2, seq_len=10)
    _check_valid(plan, 3, 4, 2, 10, np.array([1, 1, 1]))


def _digest(plan) -> str:
    return hashlib.sha256(repr(plan.micro_batches).encode()).hexdigest()


def test_identical_inputs_give_identical_plans():
    costs, tokens = _long_tail(3000, seed=11)
    a = plan_step(costs, tokens, dp_size=64, micro_batches=4, seq_len=16384)
    b = plan_step(costs.copy(), tokens.copy(), dp_size=64, micro_batches=4, seq_len=16384)
    assert _digest(a) == _digest(b)


def test_plan_is_identical_in_another_process():
    costs, tokens = _long_tail(3000, seed=12)
    here = _digest(plan_step(costs, tokens, dp_size=64, micro_batches=4, seq_len=16384))
    code = ("import hashlib, numpy as np\n"
            "from tests.balance.test_planner import _long_tail, _digest\n"
            "from loongforge.balance.planner import plan_step\n"
            "c, t = _long_tail(3000, seed=12)\n"
            "print(_digest(plan_step(c, t, dp_size=64, micro_batches=4, seq_len=16384)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


def test_latency_is_tens_of_milliseconds_at_16k_samples_dp512():
    # The documented target is p99 <= 50 ms on this machine (docs/benchmarks/balance.md); this
    # test only guards against order-of-magnitude regressions on a shared CI box.
    costs, tokens = _long_tail(16384, seed=1)
    plan_step(costs, tokens, dp_size=512, micro_batches=4, seq_len=16384)  # warm-up
    start = time.perf_counter()
    plan = plan_step(costs, tokens, dp_size=512, micro_batches=4, seq_len=16384)
    assert time.perf_counter() - start < 1.0
    assert plan.stats["max_over_lb"] <= NEAR_LB


def test_exchange_lists_route_every_sample_from_its_owner_to_its_planned_rank():
    from loongforge.balance.planner import exchange_lists

    costs, tokens = _long_tail(200, seed=4)
    owner = np.repeat(np.arange(4), 50)  # rank r loaded samples 50r .. 50r+49
    plan = plan_step(costs, tokens, dp_size=4, micro_batches=4, seq_len=16384)
    sends = exchange_lists(plan.rank_of, owner, 4)
    seen = []
    for src in range(4):
        for dst in range(4):
            for i in sends[src][dst]:
                assert owner[i] == src and plan.rank_of[i] == dst
            seen.extend(sends[src][dst])
    assert sorted(seen) == list(range(200))
    # A rank with nothing to send still gets (empty) lists for every peer.
    plan = plan_step(np.ones(3), np.ones(3, dtype=int), dp_size=4, micro_batches=1, seq_len=10)
    sends = exchange_lists(plan.rank_of, [0, 0, 0], 4)
    assert all(len(sends[s]) == 4 for s in range(4)) and sends[3] == [[], [], [], []]


# A real step from `bench train` (arena-hard, seq_len 4096, DP=2, 2 micro-batches; fitted CPU costs,
# the LM head on loss tokens): packed to 97% of capacity, so cost-first placement finds no room and
# the micro-batch-level fallback ended 10% above LB. A swap of two similar-length samples of very
# different loss share between particular micro-batches of the two ranks reaches 1.002.
TIGHT_COSTS = np.array([4.19, 6.49, 0.73, 2.37, 4.75, 3.0, 2.04, 1.63, 0.70, 1.63, 1.85, 9.23, 1.18])
TIGHT_TOKENS = np.array([1524, 2113, 305, 1295, 1565, 1020, 1022, 1085, 1366, 607, 633, 3007, 410])
TIGHT_ARRIVAL = (np.repeat([0, 0, 1, 1], [3, 3, 4, 3]), np.repeat([0, 1, 0, 1], [3, 3, 4, 3]))


def _assert_valid(plan, n, seq_len):
    assert sorted(i for rank in plan.micro_batches for mb in rank for i in mb) == list(range(n))
    assert (plan.slot_tokens <= seq_len).all()


def test_tightly_packed_small_step_is_polished_across_ranks():
    from loongforge.balance.planner import plan_from_assignment, refine_assignment

    arrival = plan_from_assignment(*TIGHT_ARRIVAL, TIGHT_COSTS, TIGHT_TOKENS, dp_size=2, micro_batches=2)
    assert arrival.stats["max_over_lb"] > 1.08
    plan = plan_step(TIGHT_COSTS, TIGHT_TOKENS, dp_size=2, micro_batches=2, seq_len=4096)
    _assert_valid(plan, 13, 4096)
    assert plan.stats["max_over_lb"] <= TIGHT_LB
    polished = refine_assignment(*TIGHT_ARRIVAL, TIGHT_COSTS, TIGHT_TOKENS, dp_size=2, micro_batches=2,
                                 seq_len=4096)
    _assert_valid(polished, 13, 4096)
    assert polished.stats["max_over_lb"] <= 1.002  # docs/benchmarks/train_balance.md: "reach 1.002"
    # Deterministic, and the input arrays are left alone.
    again = refine_assignment(*TIGHT_ARRIVAL, TIGHT_COSTS, TIGHT_TOKENS, dp_size=2, micro_batches=2,
                              seq_len=4096)
    assert np.array_equal(again.rank_of, polished.rank_of) and TIGHT_ARRIVAL[0][3] == 0
