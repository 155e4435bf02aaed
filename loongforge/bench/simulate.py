"""Simulated training steps: how each strategy would balance real sample costs at a given DP size.

A step is what unbalanced training would run: samples drawn in a seeded random order (the pool is
reshuffled each time it runs out) and packed in arrival order into ``dp * micro_batches`` packs of
``seq_len`` tokens. Every strategy then places the same samples; the step's modelled time is its
slowest rank's total cost (``objective="sum"``). Pure numpy; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from loongforge.bench.baselines import plan_none, plan_reference, plan_reference_always, plan_token
from loongforge.balance.planner import PlanError, StepPlan, plan_step

STRATEGY_NAMES = ("none", "token", "reference", "loongforge")


def _plan_loongforge(costs, tokens, *, dp_size, micro_batches, seq_len) -> StepPlan:
    return plan_step(costs, tokens, dp_size=dp_size, micro_batches=micro_batches, seq_len=seq_len)


PLANNERS: dict[str, Callable[..., StepPlan]] = {
    "none": plan_none, "token": plan_token, "reference": plan_reference, "loongforge": _plan_loongforge,
    # Ablation for the docs: the reference's planner without its skip rules.
    "reference-always": plan_reference_always}


class StepSampler:
    """Draws steps from a pool of samples: seeded permutations, next-fit into dp*m packs."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        if self.tokens.size == 0:
            raise PlanError("the sample pool is empty")
        if int(self.tokens.max()) > seq_len:
            raise PlanError(f"the pool has samples of up to {int(self.tokens.max())} tokens > "
                            f"seq_len={seq_len}: drop them or raise --seq-len")
        self.seq_len = seq_len
        self._tokens_list = self.tokens.tolist()  # Python ints: the packing loop is scalar
        self.rng = np.random.default_rng(seed)
        self._order = self.rng.permutation(self.tokens.size)
        self._cursor = 0

    def _next(self) -> int:
        if self._cursor == self._order.size:
            self._order, self._cursor = self.rng.permutation(self.tokens.size), 0
        i = int(self._order[self._cursor])
        self._cursor += 1
        return i

    def draw(self, packs: int) -> np.ndarray:
        """Indices (arrival order) of the samples filling ``packs`` packs; the sample that would
        open the next pack is kept for the next step."""
        chosen: list[int] = []
        tokens = self._tokens_list
        pack, used = 0, 0
        while True:
            i = self._next()
            t = tokens[i]
            if used + t > self.seq_len and used > 0:
                pack, used = pack + 1, 0
                if pack == packs:
                    self._cursor -= 1  # put it back
                    return np.asarray(chosen, dtype=np.int64)
            chosen.append(i)
            used += t


@dataclass
class StrategyResult:
    """Per-step figures of one strategy at one (dp, micro_batches)."""

    step_cost: list = field(default_factory=list)
    max_over_mean: list = field(default_factory=list)
    max_over_lb: list = field(default_factory=list)
    plan_ms: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # summed counters (skips, violations, repairs)


def simulate_config(costs: np.ndarray, tokens: np.ndarray, *, dp_size: int, micro_batches: int,
                    seq_len: int, steps: int, seed: int = 0,
                    strategies: Sequence[str] = STRATEGY_NAMES) -> dict[str, StrategyResult]:
    """Run ``steps`` simulated steps at one (dp, micro_batches) for each strategy."""
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    sampler = StepSampler(tokens, seq_len, seed=[seed, dp_size, micro_batches])
    results = {name: StrategyResult() for name in strategies}
    for _ in range(steps):
        chosen = sampler.draw(dp_size * micro_batches)
        c, t = costs[chosen], tokens[chosen]
        for name in strategies:
            plan = PLANNERS[name](c, t, dp_size=dp_size, micro_batches=micro_batches, seq_len=seq_len)
            res = results[name]
            res.step_cost.append(plan.stats["step_cost"])
            res.max_over_mean.append(plan.stats["max_over_mean"])
            res.max_over_lb.append(plan.stats["max_over_lb"])
            res.plan_ms.append(plan.plan_ms)
            for key in ("capacity_violations", "repairs", "skipped_sample_over_mean",
                        "skipped_balanced", "applied"):
                if key in plan.stats:
                    res.extra[key] = res.extra.get(key, 0) + int(plan.stats[key])
    return results


def summarize(dp_size: int, micro_batches: int, results: dict[str, StrategyResult]) -> list[dict]:
    """One row per strategy: means over steps; gain = total time of none / total time - 1."""
    base = float(np.sum(results["none"].step_cost)) if "none" in results else None
    rows = []
    for name, res in results.items():
        total = float(np.sum(res.step_cost))
        rows.append({
            "dp": dp_size, "ga": micro_batches, "strategy": name,
            "max_over_mean": float(np.mean(res.max_over_mean)),
            "max_over_lb": float(np.mean(res.max_over_lb)),
            "gain": (base / total - 1.0) if base is not None and total > 0 else 0.0,
            "plan_ms_p50": float(np.percentile(res.plan_ms, 50)),
            "plan_ms_p99": float(np.percentile(res.plan_ms, 99)),
        })
    return rows


def simulate(costs: np.ndarray, tokens: np.ndarray, *, dp_sizes: Iterable[int],
             micro_batches: Iterable[int], seq_len: int, steps: int, seed: int = 0,
             strategies: Sequence[str] = STRATEGY_NAMES,
             on_config: Callable[[int, int, dict], None] | None = None) -> list[dict]:
    """The whole table: rows for every (dp, micro_batches, strategy)."""
    unknown = [s for s in strategies if s not in PLANNERS]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {list(PLANNERS)}")
    rows = []
    for m in micro_batches:
        for dp in dp_sizes:
            results = simulate_config(costs, tokens, dp_size=dp, micro_batches=m, seq_len=seq_len,
                                      steps=steps, seed=seed, strategies=strategies)
            rows.extend(summarize(dp, m, results))
            if on_config is not None:
                on_config(dp, m, results)
    return rows
