"""The strategies ``bench balance`` compares the planner with, each as its source documents it.

- ``none``: fixed-length packs in arrival order (next-fit into ``seq_len`` tokens), pack ``k`` to
  rank ``k // micro_batches``, micro-batch ``k % micro_batches``: what training does unbalanced.
- ``token``: equal token counts, as verl balances its DP ranks: Karmarkar-Karp (largest differencing)
  on sample lengths into ``dp`` partitions of equal sample counts; each rank's samples are then split
  into its micro-batches by tokens, largest first into the emptiest (verl's dynamic batching has no
  fixed micro-batch count; a micro-batch may overflow ``seq_len``, which is counted).
- ``reference``: the reference system's balancer as its design notes describe it (those notes are
  not part of this repository); ``plan_reference`` writes out every rule it follows.

Every function returns a ``StepPlan`` (``loongforge.balance.planner``) so the bench scores all
strategies the same way; ``stats["capacity_violations"]`` counts micro-batches over ``seq_len``.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from loongforge.balance.planner import PlanError, StepPlan, plan_from_assignment

# The reference system's documented constants.
REFERENCE_TOKEN_CAP = 1.2  # a rank's tokens in one micro-batch stay under 1.2 x the mean
REFERENCE_MAX_ROUNDS = 20  # move/swap rounds at most
REFERENCE_STOP_SPREAD = 0.05  # stop refining when (max - min) / min < 5%
REFERENCE_SKIP_IMBALANCE = 0.2  # skip when max/mean - 1 < 0.2


def next_fit_packs(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Pack index of each sample when packing in arrival order, a new pack whenever the next
    sample does not fit in the current one."""
    pack = np.empty(len(tokens), dtype=np.int64)
    current, used = 0, 0
    for i, t in enumerate(np.asarray(tokens, dtype=np.int64).tolist()):
        if t > seq_len:
            raise PlanError(f"sample {i} has {t} tokens > seq_len={seq_len}")
        if used + t > seq_len and used > 0:
            current, used = current + 1, 0
        pack[i] = current
        used += t
    return pack


def _finish(rank_of, mb_of, costs, tokens, dp, m, seq_len, start, **extra) -> StepPlan:
    plan = plan_from_assignment(rank_of, mb_of, costs, tokens, dp_size=dp, micro_batches=m,
                                plan_ms=(time.perf_counter() - start) * 1e3)
    plan.stats["capacity_violations"] = int((plan.slot_tokens > seq_len).sum())
    plan.stats.update(extra)
    return plan


# ----------------------------------------------------------------------------------------- none


def plan_none(costs, tokens, *, dp_size: int, micro_batches: int, seq_len: int) -> StepPlan:
    """Fixed-length packs in arrival order (input order)."""
    start = time.perf_counter()
    tokens = np.asarray(tokens, dtype=np.int64)
    pack = next_fit_packs(tokens, seq_len)
    packs = int(pack[-1]) + 1 if pack.size else 0
    if packs > dp_size * micro_batches:
        raise PlanError(f"arrival-order packing needs {packs} packs of {seq_len} tokens but the step "
                        f"has dp_size * micro_batches = {dp_size * micro_batches}")
    return _finish(pack // micro_batches, pack % micro_batches, costs, tokens, dp_size,
                   micro_batches, seq_len, start)


# ---------------------------------------------------------------------------------------- token


@dataclass
class _KKState:
    sums: np.ndarray  # [k] token total of each partition
    parts: list  # k lists of sample indices

    @property
    def spread(self) -> float:
        return float(self.sums.max() - self.sums.min())


def karmarkar_karp_equal(lengths: np.ndarray, k: int) -> list[list[int]]:
    """Largest differencing into ``k`` partitions of equal count (lengths padded with zeros to a
    multiple of k; the padding is dropped from the result). Ties broken by index."""
    lengths = np.asarray(lengths, dtype=np.float64)
    n = lengths.size
    padded = -(-n // k) * k if n else k
    values = np.concatenate([lengths, np.zeros(padded - n)])
    order = np.lexsort((np.arange(padded), -values))
    heap = []
    for g, offset in enumerate(range(0, padded, k)):
        group = order[offset:offset + k]
        state = _KKState(sums=values[group].copy(), parts=[[int(i)] for i in group])
        heapq.heappush(heap, (-state.spread, g, state))
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # Pair a's heaviest partitions with b's lightest.
        a_desc = np.lexsort((np.arange(k), -a.sums))
        b_asc = np.lexsort((np.arange(k), b.sums))
        merged = _KKState(sums=a.sums[a_desc] + b.sums[b_asc],
                          parts=[a.parts[i] + b.parts[j] for i, j in zip(a_desc, b_asc)])
        heapq.heappush(heap, (-merged.spread, counter, merged))
        counter += 1
    parts = heap[0][2].parts
    return [sorted(i for i in part if i < n) for part in parts]


def _split_by_tokens(rank_of, tokens, dp, m) -> np.ndarray:
    """Each rank's samples into m micro-batches: longest first into the emptiest (overflow allowed)."""
    n = rank_of.size
    mb_of = np.empty(n, dtype=np.int64)
    fill = np.zeros((dp, m), dtype=np.int64)
    order = np.lexsort((np.arange(n), -tokens, rank_of))
    counts = np.bincount(rank_of, minlength=dp)
    position = np.arange(n) - np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    for k in range(int(counts.max()) if n else 0):
        items = order[position == k]
        ranks = rank_of[items]
        target = np.argmin(fill[ranks], axis=1)
        mb_of[items] = target
        fill[ranks, target] += tokens[items]
    return mb_of


def plan_token(costs, tokens, *, dp_size: int, micro_batches: int, seq_len: int) -> StepPlan:
    """Equal token counts per rank (Karmarkar-Karp, equal sample counts), as verl does."""
    start = time.perf_counter()
    tokens = np.asarray(tokens, dtype=np.int64)
    rank_of = np.empty(tokens.size, dtype=np.int64)
    for r, part in enumerate(karmarkar_karp_equal(tokens, dp_size)):
        rank_of[part] = r
    mb_of = _split_by_tokens(rank_of, tokens, dp_size, micro_batches)
    return _finish(rank_of, mb_of, costs, tokens, dp_size, micro_batches, seq_len, start)


# ------------------------------------------------------------------------------------ reference


def plan_reference(costs, tokens, *, dp_size: int, micro_batches: int, seq_len: int,
                   planner_costs=None, skip_rules: bool = True) -> StepPlan:
    """The reference system's balancer, as its design notes describe it, micro-batch by micro-batch.

    Samples arrive as ``plan_none`` places them. For micro-batch slot j = 0..m-1, over the samples
    all ranks loaded for slot j, with ``planner_costs`` (default: token counts, what it uses before
    its fit) and a tracker of each rank's planned cost in slots < j:
    - skip rule 1: a sample's cost exceeds the mean rank load of this micro-batch (sum / dp);
    - skip rule 2: with the tracker, the arrival loads' max/mean - 1 < 0.2;
      a skipped slot keeps its arrival assignment;
    - otherwise LPT: costliest first, each to the cheapest rank (tracker included) whose token total
      in this micro-batch stays under 1.2 x the mean (the cheapest rank overall if none does), then
      at most 20 rounds of the best move, else the best swap, between the most and least loaded
      ranks, stopping when (max - min) / min < 5% or nothing improves.
    The tracker then adds the slot's planned costs. ``stats`` counts skips by rule and applies.
    ``skip_rules=False`` (not the reference's behaviour) always rebalances, to measure its planner
    on its own.
    """
    start = time.perf_counter()
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    own = tokens.astype(np.float64) if planner_costs is None else np.asarray(planner_costs, np.float64)
    arrival = plan_none(costs, tokens, dp_size=dp_size, micro_batches=micro_batches, seq_len=seq_len)
    rank_of = arrival.rank_of.copy()
    mb_of = arrival.micro_batch_of.copy()
    tracker = np.zeros(dp_size)
    counts = {"skipped_sample_over_mean": 0, "skipped_balanced": 0, "applied": 0}
    for j in range(micro_batches):
        items = np.flatnonzero(mb_of == j)
        arrival_ranks = rank_of[items]
        decision = reference_skip_rule(own[items], arrival_ranks, tracker, dp_size) if skip_rules else None
        if decision is None:
            new_ranks = _reference_lpt(own[items], tokens[items], tracker, dp_size)
            new_ranks = _reference_refine(new_ranks, own[items], tokens[items], tracker, dp_size)
            rank_of[items] = new_ranks
            counts["applied"] += 1
        else:
            counts[decision] += 1
        tracker += np.bincount(rank_of[items], weights=own[items], minlength=dp_size)
    return _finish(rank_of, mb_of, costs, tokens, dp_size, micro_batches, seq_len, start, **counts)


def reference_skip_rule(slot_costs: np.ndarray, arrival_ranks: np.ndarray, tracker: np.ndarray,
                        dp_size: int) -> str | None:
    """Which of the reference's skip rules fires for one micro-batch slot (None: rebalance)."""
    if slot_costs.size == 0:
        return "skipped_balanced"
    if slot_costs.max() > slot_costs.sum() / dp_size:
        return "skipped_sample_over_mean"
    loads = tracker + np.bincount(arrival_ranks, weights=slot_costs, minlength=dp_size)
    mean = loads.mean()
    if mean <= 0 or loads.max() / mean - 1 < REFERENCE_SKIP_IMBALANCE:
        return "skipped_balanced"
    return None


def _reference_lpt(c, t, tracker, dp) -> np.ndarray:
    loads = tracker.copy()
    fill = np.zeros(dp)
    cap = REFERENCE_TOKEN_CAP * t.sum() / dp
    ranks = np.empty(c.size, dtype=np.int64)
    for i in np.lexsort((np.arange(c.size), -c)).tolist():
        under = fill + t[i] < cap
        r = int(np.argmin(np.where(under, loads, np.inf))) if under.any() else int(np.argmin(loads))
        ranks[i] = r
        loads[r] += c[i]
        fill[r] += t[i]
    return ranks


def _reference_refine(ranks, c, t, tracker, dp) -> np.ndarray:
    ranks = ranks.copy()
    cap = REFERENCE_TOKEN_CAP * t.sum() / dp
    for _ in range(REFERENCE_MAX_ROUNDS):
        loads = tracker + np.bincount(ranks, weights=c, minlength=dp)
        fill = np.bincount(ranks, weights=t, minlength=dp)
        hi, lo = int(np.argmax(loads)), int(np.argmin(loads))
        if loads[lo] <= 0 or (loads[hi] - loads[lo]) / loads[lo] < REFERENCE_STOP_SPREAD:
            break
        a_items, b_items = np.flatnonzero(ranks == hi), np.flatnonzero(ranks == lo)
        peak = loads[hi]
        # Best move hi -> lo under the token cap.
        move_after = np.maximum(peak - c[a_items], loads[lo] + c[a_items])
        move_after[fill[lo] + t[a_items] >= cap] = np.inf
        # Best swap.
        delta = c[a_items][:, None] - c[b_items][None, :]
        swap_after = np.maximum(peak - delta, loads[lo] + delta)
        dtok = t[a_items][:, None] - t[b_items][None, :]
        swap_after[(delta <= 0) | (fill[lo] + dtok >= cap)] = np.inf
        best_move = move_after.min() if move_after.size else np.inf
        best_swap = swap_after.min() if swap_after.size else np.inf
        if min(best_move, best_swap) >= peak:
            break
        if best_move <= best_swap:
            ranks[a_items[int(np.argmin(move_after))]] = lo
        else:
            ia, ib = np.unravel_index(int(np.argmin(swap_after)), swap_after.shape)
            ranks[a_items[ia]], ranks[b_items[ib]] = lo, hi
    return ranks


def plan_reference_always(costs, tokens, *, dp_size: int, micro_batches: int, seq_len: int) -> StepPlan:
    """The reference's planner with its skip rules off (an ablation, not the reference itself)."""
    return plan_reference(costs, tokens, dp_size=dp_size, micro_batches=micro_batches,
                          seq_len=seq_len, skip_rules=False)
