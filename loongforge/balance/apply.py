"""Per-step balancing decisions, the same in both ways of applying them.

Manifest mode: every data-parallel rank knows every sample of the step (it measured the global row
stream, or read a packed manifest: exact token counts and image / video grids, no pixels), so every
rank prices the step's samples with the same cost model, computes the same plan, and materialises
only its own samples. No data moves.

Exchange mode (``loongforge.data.exchange``): each rank loads only its own share; the ranks
all-gather the samples' sizes (``SampleSize``), compute the same plan here, and move samples.

For one step (``rows``: the step's packed rows in arrival order, ``dp * micro_batches`` of them):
1. price each sample: language term from its length L, vision term from each image's / video's
   patches t*h*w (``CostModel.sample_costs``);
2. score the arrival assignment (row i -> rank i // micro_batches, micro-batch i % micro_batches);
3. if its max/LB - 1 is below ``threshold``, keep it (skipped); otherwise plan the step afresh
   (``plan_step``) and polish the arrival assignment (``refine_assignment``), and use the better of
   the two when it beats the arrival, every micro-batch holding at least one sample.

With ``whole_rows`` (a model whose objective holds a statistic of each row: an MoE's load-balancing loss)
the rows are the units: step 3 deals whole rows to (rank, micro-batch) slots instead (``_row_plan``), so every
micro-batch trains one of the step's rows as it arrived and balancing changes which rank trains it, never
which samples share it.

The result is a pure function of the rows and the cost model's coefficients: identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from loongforge.balance.cost_model import CostModel, token_count_model
from loongforge.balance.planner import PlanError, plan_from_assignment, plan_step, refine_assignment


@dataclass
class BalanceDecision:
    """One step's outcome. ``micro_batches[r][m]``: indices into the step's samples (rows
    flattened in order) that rank ``r`` trains in micro-batch ``m``."""

    micro_batches: list[list[list[int]]]
    applied: bool
    before: float  # max/LB of the arrival assignment
    after: float  # max/LB of what is trained (== before when not applied)
    reason: str = ""  # why a step was not applied: "below threshold", "no gain", "empty micro-batch", ...


@dataclass(frozen=True)
class SampleSize:
    """What pricing a sample needs: its LLM length and each image's / video's vision patches.
    Small and picklable: exchange mode all-gathers these instead of the samples."""

    length: int
    patches: tuple[int, ...] = ()
    loss_tokens: int = 0  # tokens the loss is computed on (the LM head runs on these only)


def sample_patches(sample) -> list[int]:
    """Vision patches (t*h*w) of each image and video of a MeasuredSample (or a SampleSize)."""
    if isinstance(sample, SampleSize):
        return list(sample.patches)
    grids = list(sample.image_grids) + [plan.grid_thw for plan in sample.video_plans]
    return [int(t) * int(h) * int(w) for t, h, w in grids]


def sample_size(sample) -> SampleSize:
    """A MeasuredSample's (or a SampleSize's) size for pricing."""
    return SampleSize(int(sample.length), tuple(sample_patches(sample)), int(sample.loss_tokens))


def _fill_empty(lists: list[list[list[int]]], costs: np.ndarray) -> Optional[list[list[list[int]]]]:
    """Give every empty micro-batch one sample from the same rank's fullest micro-batch (its
    cheapest sample): a rank's total cost is unchanged. None when a rank has fewer samples than
    micro-batches (no valid plan keeps its samples)."""
    out = [[list(mb) for mb in rank] for rank in lists]
    for rank in out:
        if sum(len(mb) for mb in rank) < len(rank):
            return None
        for empty in [j for j, mb in enumerate(rank) if not mb]:
            donor = max(range(len(rank)), key=lambda j: (len(rank[j]), -j))
            sample = min(rank[donor], key=lambda i: (costs[i], i))
            rank[donor].remove(sample)
            rank[empty].append(sample)
        for mb in rank:
            mb.sort()
    return out


def _row_plan(row_of: np.ndarray, costs: np.ndarray, *, dp_size: int, micro_batches: int) -> list[list[list[int]]]:
    """Whole rows dealt to (rank, micro-batch) slots, one row each: the rows by cost, dearest first, dp_size at a
    time into one micro-batch slot (rows of like cost run side by side, as a pipeline's synchronised slots want),
    each of them to the rank with the least load so far (ties: the lower rank). ``row_of`` [samples]: each
    sample's row; ``costs`` [samples]. -> ``BalanceDecision.micro_batches``."""
    num_rows = dp_size * micro_batches
    row_costs = np.bincount(row_of, weights=costs, minlength=num_rows)  # [rows]
    dearest_first = sorted(range(num_rows), key=lambda row: (-row_costs[row], row))
    loads = np.zeros(dp_size)
    lists: list[list[list[int]]] = [[[] for _ in range(micro_batches)] for _ in range(dp_size)]
    for slot in range(micro_batches):
        free = list(range(dp_size))
        for row in dearest_first[slot * dp_size:(slot + 1) * dp_size]:
            rank = min(free, key=lambda r: (loads[r], r))
            free.remove(rank)
            loads[rank] += row_costs[row]
            lists[rank][slot] = [int(i) for i in np.flatnonzero(row_of == row)]
    return lists


class StepBalancer:
    """Decides, per step, which rank trains which samples; see the module docstring."""

    def __init__(self, *, dp_size: int, micro_batches: int, seq_len: int, threshold: float,
                 objective: str = "sum", cost_model: Optional[CostModel] = None, whole_rows: bool = False):
        self.whole_rows = whole_rows
        self.dp_size = dp_size
        self.num_micro_batches = micro_batches
        self.seq_len = seq_len
        self.threshold = threshold
        self.objective = objective
        self.cost_model = cost_model or token_count_model()

    def decide(self, rows: Sequence[Sequence]) -> BalanceDecision:
        dp, m = self.dp_size, self.num_micro_batches
        if len(rows) != dp * m:
            raise ValueError(f"{len(rows)} rows for dp_size={dp} x micro_batches={m}")
        samples = [s for row in rows for s in row]
        tokens = np.array([s.length for s in samples], dtype=np.int64)
        costs = self.cost_model.sample_costs(tokens, [sample_patches(s) for s in samples],
                                             [s.loss_tokens for s in samples])
        row_of = np.repeat(np.arange(len(rows)), [len(row) for row in rows])
        arrival = plan_from_assignment(row_of // m, row_of % m, costs, tokens, dp_size=dp,
                                       micro_batches=m, objective=self.objective)
        before = float(arrival.stats["max_over_lb"])

        def keep(reason: str) -> BalanceDecision:
            return BalanceDecision(arrival.micro_batches, False, before, before, reason)

        if before - 1.0 < self.threshold:
            return keep("below threshold")
        if self.whole_rows:
            lists = _row_plan(row_of, costs, dp_size=dp, micro_batches=m)
            after = self._score(lists, costs, tokens)
            return BalanceDecision(lists, True, before, after) if after < before else keep("no gain")
        candidates = []
        try:
            candidates.append(plan_step(costs, tokens, dp_size=dp, micro_batches=m, seq_len=self.seq_len,
                                        objective=self.objective))
        except PlanError:
            pass
        # The arrival order polished: on tightly packed small steps it can beat a fresh plan.
        candidates.append(refine_assignment(row_of // m, row_of % m, costs, tokens, dp_size=dp,
                                            micro_batches=m, seq_len=self.seq_len, objective=self.objective))
        best = None
        for candidate in candidates:
            lists = _fill_empty(candidate.micro_batches, costs)
            if lists is None:
                continue
            after = self._score(lists, costs, tokens)
            if best is None or after < best[0]:
                best = (after, lists)
        if best is None:
            return keep("empty micro-batch")
        if best[0] >= before:
            return keep("no gain")
        return BalanceDecision(best[1], True, before, best[0])

    def _score(self, lists: list[list[list[int]]], costs: np.ndarray, tokens: np.ndarray) -> float:
        """max/LB of an assignment given as micro-batch lists."""
        rank_of = np.empty(costs.size, dtype=np.int64)
        mb_of = np.empty(costs.size, dtype=np.int64)
        for r, rank in enumerate(lists):
            for j, mb in enumerate(rank):
                rank_of[mb], mb_of[mb] = r, j
        plan = plan_from_assignment(rank_of, mb_of, costs, tokens, dp_size=self.dp_size,
                                    micro_batches=self.num_micro_batches, objective=self.objective)
        return float(plan.stats["max_over_lb"])


class BalanceCounters:
    """Applied / skipped steps and mean max/LB before and after, over consumed steps."""

    def __init__(self):
        self.applied = 0
        self.skipped = 0
        self._before = 0.0
        self._after = 0.0

    def add(self, decision: BalanceDecision) -> None:
        if decision.applied:
            self.applied += 1
        else:
            self.skipped += 1
        self._before += decision.before
        self._after += decision.after

    def as_dict(self) -> dict:
        steps = self.applied + self.skipped
        return {"applied_steps": self.applied, "skipped_steps": self.skipped,
                "mean_max_over_lb_before": self._before / steps if steps else None,
                "mean_max_over_lb_after": self._after / steps if steps else None}
