"""The step planner: which DP rank trains which sample in which micro-batch.

Input: every sample of one optimizer step (all micro-batches of all data-parallel ranks), each with
a modelled cost (seconds, from ``CostModel.sample_costs``) and a length in tokens. Output: a
``StepPlan`` in which every sample is assigned exactly once, every rank gets exactly
``micro_batches`` micro-batches, and no micro-batch holds more than ``seq_len`` tokens.

Objectives:
- ``"sum"`` (default): ranks synchronise once per step, at the gradient all-reduce, so the step
  takes as long as the slowest rank: minimise the maximum per-rank cost (sum over its micro-batches).
- ``"slots"``: under pipeline parallelism every micro-batch slot synchronises, so the step takes
  the sum over slots of the slowest rank in that slot: minimise that sum.

Method (near-optimal, tens of milliseconds at 16k samples and 512 ranks):
1. Longest-processing-time greedy with a token capacity, dealt in rounds: the bins whose load is
   below (least load + next sample's cost) are those sequential LPT would fill next, so that many
   of the costliest remaining samples go to them, costliest to least loaded; a sample that would
   overflow its bin's tokens goes to the least-loaded bin that still has room.
2. Move/swap refinement while the most loaded bin is above the target ``(1 + tolerance) * LB``:
   in rounds, the bins above the target are paired heaviest-with-lightest and each pair applies
   the move or swap that lowers its maximum most (all pairs in one numpy step); when no pair can
   improve, the most loaded bin alone tries its best move/swap with the least loaded bins. Stops
   when that fails too.
3. ``"sum"``: steps 1-2 run on ``dp`` bins of ``micro_batches * seq_len`` tokens; each rank's
   samples are then dealt, longest first, over its micro-batches in snake order, or where that
   overflows a micro-batch, worst-fit decreasing by tokens; a sample that fits nowhere moves to the
   least-loaded rank with room. ``"slots"`` (and ``micro_batches == 1``): steps 1-2 run on
   ``dp * micro_batches`` bins of ``seq_len`` tokens, and the bins are dealt to slots in cost order
   (the ``dp`` costliest share slot 0, and so on), which minimises the sum of per-slot maxima for
   those bins.
4. When the step is packed so tightly that cost-first placement finds no room (``stats["fallback"]``),
   the plan starts from a packing that fits (input order packed next-fit, as the data pipeline packs
   rows, else first-fit decreasing) and refines it micro-batch by micro-batch.
5. ``"sum"``: while the slowest rank is above the target, moves and swaps between it and the least
   loaded ranks that keep every sample in a micro-batch with room (``refine_assignment`` runs the
   same polish on any assignment, e.g. the arrival order).

Lower bound: LB = max(total cost / dp, largest sample cost); ``max_over_lb`` is how far the plan is
from it (1.0 is optimal). The planner is pure numpy, uses no clock or randomness in its decisions,
and breaks every tie by index: identical inputs give the identical plan on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import numpy as np

Objective = Literal["sum", "slots"]
OBJECTIVES = ("sum", "slots")

# Stop refining once the slowest rank is within 0.2% of the lower bound: well below the cost
# model's error, and about half the refinement work of 0.1% at 16k samples, DP=512.
DEFAULT_TOLERANCE = 2e-3
# Candidate partners per refinement round (the least loaded bins); more finds rarer fixes, slower.
DEFAULT_PARTNERS = 8


class PlanError(ValueError):
    """The step cannot be planned as asked (it does not fit); the message says what to change."""


class _NoRoom(Exception):
    """Cost-first placement found no bin with room for a sample (the step is packed tightly)."""


@dataclass
class StepPlan:
    """Where each sample of one step runs.

    ``micro_batches[r][m]`` lists the input indices of the samples rank ``r`` trains in its
    micro-batch ``m`` (in ascending index order); ``rank_of[i]`` / ``micro_batch_of[i]`` say the
    same per sample. ``rank_costs`` [dp] and ``slot_costs`` [dp, micro_batches] are modelled costs.
    """

    rank_of: np.ndarray  # int64 [n]
    micro_batch_of: np.ndarray  # int64 [n]
    rank_costs: np.ndarray  # float64 [dp]
    slot_costs: np.ndarray  # float64 [dp, micro_batches]
    slot_tokens: np.ndarray  # int64 [dp, micro_batches]
    objective: str
    lower_bound: float
    plan_ms: float  # wall-clock planning time
    repairs: int = 0  # samples moved after refinement because no micro-batch of their rank had room
    stats: dict = field(default_factory=dict)
    _lists: Optional[list] = field(default=None, repr=False, compare=False)

    @property
    def dp_size(self) -> int:
        return self.slot_costs.shape[0]

    @property
    def num_micro_batches(self) -> int:
        return self.slot_costs.shape[1]

    @property
    def micro_batches(self) -> list[list[list[int]]]:
        """[rank][micro-batch] -> ascending sample indices (built on first use)."""
        if self._lists is None:
            dp, m = self.slot_costs.shape
            flat = self.rank_of * m + self.micro_batch_of
            order = np.argsort(flat, kind="stable")
            bounds = np.searchsorted(flat[order], np.arange(dp * m + 1)).tolist()
            ordered = order.tolist()
            self._lists = [[ordered[bounds[r * m + j]:bounds[r * m + j + 1]] for j in range(m)]
                           for r in range(dp)]
        return self._lists

    def step_cost(self) -> float:
        """Modelled step time under this plan's objective."""
        return step_cost(self.slot_costs, self.objective)

    def samples_of(self, rank: int) -> list[int]:
        """All samples rank ``rank`` trains this step, micro-batch by micro-batch."""
        return [i for mb in self.micro_batches[rank] for i in mb]


def lower_bound(costs: np.ndarray, dp_size: int) -> float:
    """LB = max(total cost / dp, largest sample cost): no plan's slowest rank is faster."""
    costs = np.asarray(costs, dtype=np.float64)
    if costs.size == 0:
        return 0.0
    return float(max(costs.sum() / dp_size, costs.max()))


def step_cost(slot_costs: np.ndarray, objective: str = "sum") -> float:
    """Step time from per-rank per-micro-batch costs [dp, m]: max of rank sums, or sum of slot maxima."""
    slot_costs = np.asarray(slot_costs, dtype=np.float64)
    if objective == "slots":
        return float(slot_costs.max(axis=0).sum())
    return float(slot_costs.sum(axis=1).max())


def plan_stats(slot_costs: np.ndarray, costs: np.ndarray, objective: str = "sum") -> dict:
    """max/mean and max/LB of a plan, with max = the step cost under ``objective``."""
    dp = slot_costs.shape[0]
    total = float(np.sum(costs))
    step = step_cost(slot_costs, objective)
    mean = total / dp if dp else 0.0
    lb = lower_bound(costs, dp)
    return {"step_cost": step, "mean_cost": mean, "lower_bound": lb,
            "max_over_mean": step / mean if mean > 0 else 1.0,
            "max_over_lb": step / lb if lb > 0 else 1.0}


def check_fits(tokens: np.ndarray, *, dp_size: int, micro_batches: int, seq_len: int) -> None:
    """Raise PlanError naming the remedy when no plan can respect the token capacity."""
    if dp_size < 1 or micro_batches < 1 or seq_len < 1:
        raise PlanError(f"dp_size, micro_batches and seq_len must be >= 1, got {dp_size}, "
                        f"{micro_batches}, {seq_len}")
    if tokens.size and int(tokens.min()) < 0:
        raise PlanError("sample token counts must be >= 0")
    if tokens.size and int(tokens.max()) > seq_len:
        i = int(np.argmax(tokens))
        raise PlanError(f"sample {i} has {int(tokens[i])} tokens > seq_len={seq_len}: raise "
                        "data.seq_len or drop over-long samples before planning")
    total, room = int(tokens.sum()), dp_size * micro_batches * seq_len
    if total > room:
        raise PlanError(f"the step holds {total} tokens but dp_size * micro_batches * seq_len = "
                        f"{dp_size} * {micro_batches} * {seq_len} = {room}: put fewer samples in the "
                        "step, or raise seq_len, the DP size or the micro-batches per step")


def plan_step(costs: Sequence[float] | np.ndarray, tokens: Sequence[int] | np.ndarray, *,
              dp_size: int, micro_batches: int, seq_len: int, objective: Objective = "sum",
              tolerance: float = DEFAULT_TOLERANCE, partners: int = DEFAULT_PARTNERS) -> StepPlan:
    """Plan one step; see the module docstring. Raises PlanError when the samples cannot fit."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    if costs.shape != tokens.shape or costs.ndim != 1:
        raise PlanError(f"costs {costs.shape} and tokens {tokens.shape} must be 1-D of equal length")
    if objective not in OBJECTIVES:
        raise PlanError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if costs.size and not (np.isfinite(costs).all() and costs.min() >= 0):
        raise PlanError("sample costs must be finite and >= 0")
    check_fits(tokens, dp_size=dp_size, micro_batches=micro_batches, seq_len=seq_len)
    lb = lower_bound(costs, dp_size)

    fallback = False
    try:
        if objective == "slots" or micro_batches == 1:
            bins = dp_size * micro_batches
            target = (1 + tolerance) * lower_bound(costs, bins)
            bin_of, _ = _balance(costs, tokens, bins, seq_len, target, partners)
            rank_of, mb_of, repairs = _deal_bins(bin_of, costs, dp_size, micro_batches, objective)
        else:
            target = (1 + tolerance) * lb
            rank_of, _ = _balance(costs, tokens, dp_size, micro_batches * seq_len, target, partners)
            rank_of, mb_of, repairs = _split_micro_batches(rank_of, costs, tokens, dp_size,
                                                           micro_batches, seq_len)
    except _NoRoom:
        # The step is packed so tightly that cost-first placement found no room. Start instead
        # from a packing known to fit (the input order packed next-fit, as the pipeline packs
        # rows, else first-fit decreasing) and refine micro-batches, which keeps it feasible.
        fallback = True
        bins = dp_size * micro_batches
        bin_of = _feasible_packing(tokens, bins, seq_len)
        loads = np.bincount(bin_of, weights=costs, minlength=bins)
        fill = np.bincount(bin_of, weights=tokens, minlength=bins).astype(np.int64)
        _refine(bin_of, loads, fill, costs, tokens, seq_len,
                (1 + tolerance) * lower_bound(costs, bins), partners)
        rank_of, mb_of, repairs = _deal_bins(bin_of, costs, dp_size, micro_batches, objective)
    if objective == "sum":
        _polish_ranks(rank_of, mb_of, costs, tokens, dp_size, micro_batches, seq_len,
                      (1 + tolerance) * lb, partners)
    plan = _make_plan(rank_of, mb_of, costs, tokens, dp_size, micro_batches, objective, lb, repairs)
    plan.stats["fallback"] = fallback
    plan.plan_ms = (time.perf_counter() - start) * 1e3
    plan.stats["plan_ms"] = plan.plan_ms
    # CPU time of this thread: what planning costs without contention from other processes.
    plan.stats["plan_cpu_ms"] = (time.thread_time() - start_cpu) * 1e3
    return plan


# ------------------------------------------------------------------------------- bin balancing


def _balance(costs: np.ndarray, tokens: np.ndarray, bins: int, capacity: int, target: float,
             partners: int) -> tuple[np.ndarray, np.ndarray]:
    """Assign samples to ``bins`` bins of ``capacity`` tokens minimising the largest bin cost.

    Returns (bin of each sample [n], bin loads [bins]).
    """
    bin_of, loads, fill = _lpt(costs, tokens, bins, capacity)
    _refine(bin_of, loads, fill, costs, tokens, capacity, target, partners)
    return bin_of, loads


def _lpt(costs, tokens, bins, capacity):
    """LPT dealt in rounds: the bins whose load is below (least load + next sample's cost) are the
    ones sequential LPT would fill next, so the next that many samples go to them, costliest to
    least loaded. Equal to sequential LPT for equal costs, and a numpy step per round."""
    n = costs.size
    order = np.argsort(-costs, kind="stable")  # costliest first, ties by index
    bin_of = np.full(n, -1, dtype=np.int64)
    loads = np.zeros(bins)
    fill = np.zeros(bins, dtype=np.int64)
    start = 0
    while start < n:
        by_load = np.argsort(loads, kind="stable")
        level = loads[by_load[0]] + costs[order[start]]
        k = max(1, int(np.searchsorted(loads[by_load], level, side="left")))
        chunk = order[start:start + k]
        targets = by_load[:chunk.size]
        start += chunk.size
        fits = fill[targets] + tokens[chunk] <= capacity
        ok_items, ok_bins = chunk[fits], targets[fits]
        bin_of[ok_items] = ok_bins
        loads[ok_bins] += costs[ok_items]  # targets are distinct bins
        fill[ok_bins] += tokens[ok_items]
        for i in chunk[~fits]:  # rare: capacity binds; least-loaded bin with room
            _place_least_loaded(int(i), bin_of, loads, fill, costs, tokens, capacity)
    return bin_of, loads, fill


def _place_least_loaded(i, bin_of, loads, fill, costs, tokens, capacity) -> None:
    room = fill + tokens[i] <= capacity
    if not room.any():
        raise _NoRoom()
    b = int(np.argmin(np.where(room, loads, np.inf)))
    bin_of[i] = b
    loads[b] += costs[i]
    fill[b] += tokens[i]


def _refine(bin_of, loads, fill, costs, tokens, capacity, target, partners) -> None:
    """Lower the loaded bins below ``target`` by moves and swaps, in place.

    Each round pairs the bins above the target, heaviest first, with the lightest bins (up to
    ``PAIRS_PER_ROUND`` disjoint pairs) and applies in every pair the best move or swap, all in one
    vectorised step. When a round helps no pair, the most loaded bin alone tries the ``partners``
    lightest bins; the refinement stops when that fails too.
    """
    bins = loads.size
    if bins < 2 or bin_of.size == 0:
        return
    members = _Members(bin_of, bins)
    partners = min(partners, bins - 1)
    for _ in range(8 * bins + 64):
        if loads.max() <= target:
            return
        if _pair_round(members, bin_of, loads, fill, costs, tokens, capacity, target):
            continue
        h = int(np.argmax(loads))
        light = np.argpartition(loads, partners)[:partners + 1] if partners + 1 < bins else np.arange(bins)
        light = np.sort(light[light != h])[:partners]
        if not _improve_one(h, light, members, bin_of, loads, fill, costs, tokens, capacity):
            return


PAIRS_PER_ROUND = 32


class _Members:
    """Each bin's samples as a padded matrix (-1 = empty), updated in place on every transfer."""

    def __init__(self, bin_of: np.ndarray, bins: int):
        n = bin_of.size
        self.count = np.bincount(bin_of, minlength=bins)
        order = np.argsort(bin_of, kind="stable")
        starts = np.concatenate([[0], np.cumsum(self.count)[:-1]])
        position = np.arange(n) - np.repeat(starts, self.count)
        self.slots = np.full((bins, 2 * int(self.count.max()) + 8), -1, dtype=np.int64)
        self.slots[bin_of[order], position] = order
        self.pos = np.empty(n, dtype=np.int64)
        self.pos[order] = position

    def of(self, b: int) -> np.ndarray:
        return self.slots[b, :self.count[b]]

    def transfer(self, i: int, src: int, dst: int) -> None:
        last = self.count[src] - 1
        j = self.slots[src, last]
        self.slots[src, self.pos[i]] = j
        self.pos[j] = self.pos[i]
        self.slots[src, last] = -1
        self.count[src] -= 1
        if self.count[dst] == self.slots.shape[1]:
            self.slots = np.pad(self.slots, ((0, 0), (0, self.slots.shape[1])), constant_values=-1)
        self.slots[dst, self.count[dst]] = i
        self.pos[i] = self.count[dst]
        self.count[dst] += 1


def _pair_round(members, bin_of, loads, fill, costs, tokens, capacity, target) -> bool:
    """Best move or swap within each (heavy, light) pair at once; True if any pair improved."""
    bins = loads.size
    order = np.argsort(loads, kind="stable")
    pairs = min(PAIRS_PER_ROUND, bins // 2)
    heavy, light = order[::-1][:pairs], order[:pairs]
    keep = loads[heavy] > target
    heavy, light = heavy[keep], light[keep]
    if heavy.size == 0:
        return False
    width = int(max(members.count[heavy].max(), members.count[light].max(), 1))
    ih, il = members.slots[heavy, :width], members.slots[light, :width]
    vh, vl = ih >= 0, il >= 0
    ch, cl, th, tl = costs[ih], costs[il], tokens[ih], tokens[il]
    peak, low = loads[heavy][:, None], loads[light][:, None]
    move = np.maximum(peak - ch, low + ch)  # [pairs, width]
    move[~vh | (fill[light][:, None] + th > capacity)] = np.inf
    delta = ch[:, :, None] - cl[:, None, :]  # [pairs, width, width]
    swap = np.maximum(peak[:, :, None] - delta, low[:, :, None] + delta)
    dtok = th[:, :, None] - tl[:, None, :]
    bad = (~(vh[:, :, None] & vl[:, None, :]) | (delta <= 0)
           | (fill[light][:, None, None] + dtok > capacity) | (fill[heavy][:, None, None] - dtok > capacity))
    swap[bad] = np.inf
    swap = swap.reshape(heavy.size, -1)
    best_move, arg_move = move.min(axis=1), move.argmin(axis=1)
    best_swap, arg_swap = swap.min(axis=1), swap.argmin(axis=1)
    improved = False
    for q in range(heavy.size):
        h, b = int(heavy[q]), int(light[q])
        if min(best_move[q], best_swap[q]) >= loads[h] - 1e-12 * max(loads[h], 1e-30):
            continue
        improved = True
        if best_move[q] <= best_swap[q]:
            _transfer(int(ih[q, arg_move[q]]), h, b, members, bin_of, loads, fill, costs, tokens)
        else:
            a, x = int(ih[q, arg_swap[q] // width]), int(il[q, arg_swap[q] % width])
            _transfer(a, h, b, members, bin_of, loads, fill, costs, tokens)
            _transfer(x, b, h, members, bin_of, loads, fill, costs, tokens)
    return improved


def _improve_one(h, light, members, bin_of, loads, fill, costs, tokens, capacity) -> bool:
    """Apply the best single move or swap between bin ``h`` and any of ``light``; False when none
    lowers h's load."""
    mine = members.of(h)
    theirs = np.concatenate([members.of(int(b)) for b in light])
    owner = bin_of[theirs]
    c_h, t_h = costs[mine][:, None], tokens[mine][:, None]
    peak = loads[h]
    # Moves: sample a of h -> bin b; new pair max = max(peak - c_a, load_b + c_a).
    after = np.maximum(peak - c_h, loads[light][None, :] + c_h)
    after[fill[light][None, :] + t_h > capacity] = np.inf
    best_move = np.unravel_index(int(np.argmin(after)), after.shape)
    move_val = after[best_move]
    # Swaps: a of h <-> x of a partner bin, with c_a > c_x.
    delta = c_h - costs[theirs][None, :]
    after_s = np.maximum(peak - delta, loads[owner][None, :] + delta)
    dtok = t_h - tokens[theirs][None, :]
    bad = (delta <= 0) | (fill[owner][None, :] + dtok > capacity) | (fill[h] - dtok > capacity)
    after_s[bad] = np.inf
    swap_val = np.inf
    if after_s.size:
        best_swap = np.unravel_index(int(np.argmin(after_s)), after_s.shape)
        swap_val = after_s[best_swap]
    # Require a real gain, so float noise never makes the loop cycle.
    if min(move_val, swap_val) >= peak - 1e-12 * max(peak, 1e-30):
        return False
    if move_val <= swap_val:
        _transfer(int(mine[best_move[0]]), h, int(light[best_move[1]]), members, bin_of, loads, fill,
                  costs, tokens)
    else:
        a, x = int(mine[best_swap[0]]), int(theirs[best_swap[1]])
        b = int(owner[best_swap[1]])
        _transfer(a, h, b, members, bin_of, loads, fill, costs, tokens)
        _transfer(x, b, h, members, bin_of, loads, fill, costs, tokens)
    return True


def _transfer(i, src, dst, members, bin_of, loads, fill, costs, tokens) -> None:
    members.transfer(i, src, dst)
    bin_of[i] = dst
    loads[src] -= costs[i]
    loads[dst] += costs[i]
    fill[src] -= tokens[i]
    fill[dst] += tokens[i]


# ----------------------------------------------------------------------- rank-level polish


def _polish_ranks(rank_of, mb_of, costs, tokens, dp, m, seq_len, target, partners) -> int:
    """``"sum"`` objective: moves and swaps between the most loaded rank and the least loaded
    ones, each sample keeping to a micro-batch with room, until the slowest rank is within
    ``target`` or nothing lowers it. In place; returns how many changes it made.

    Bin-level refinement balances micro-batches or whole ranks' token totals, but when the step is
    packed tightly the fix is often a swap of two similar-length samples of different cost between
    particular micro-batches of two ranks, which only this level sees.
    """
    loads = np.bincount(rank_of, weights=costs, minlength=dp)
    fill = np.bincount(rank_of * m + mb_of, weights=tokens, minlength=dp * m).astype(np.int64).reshape(dp, m)
    changes = 0
    for _ in range(64 + dp // 8):  # bounded: the planner runs once per step, in the loader thread
        h = int(np.argmax(loads))
        if loads[h] <= target:
            break
        mine = np.flatnonzero(rank_of == h)
        best = (loads[h] - 1e-12 * max(loads[h], 1e-30), None)
        for b in np.argsort(loads, kind="stable")[:partners + 1].tolist():
            if b == h:
                continue
            best = _best_change(h, b, mine, np.flatnonzero(rank_of == b), loads, fill, rank_of, mb_of,
                                costs, tokens, seq_len, best)
        if best[1] is None:
            break
        for i, rank, mb in best[1]:  # apply the change: (sample, new rank, new micro-batch)
            loads[rank_of[i]] -= costs[i]
            fill[rank_of[i], mb_of[i]] -= tokens[i]
            rank_of[i], mb_of[i] = rank, mb
            loads[rank] += costs[i]
            fill[rank, mb] += tokens[i]
        changes += 1
    return changes


def _best_change(h, b, mine, theirs, loads, fill, rank_of, mb_of, costs, tokens, seq_len, best):
    """The best move (sample of h into b's roomiest micro-batch) or swap (a of h <-> x of b, each
    into the other's micro-batch) if it beats ``best`` = (pair maximum to beat, change)."""
    c_h, t_h = costs[mine], tokens[mine]
    room_mb = int(np.argmin(fill[b]))  # ties -> lowest index
    moves = np.maximum(loads[h] - c_h, loads[b] + c_h)  # [n_h]
    moves[fill[b, room_mb] + t_h > seq_len] = np.inf
    if moves.size and moves.min() < best[0]:
        k = int(np.argmin(moves))
        best = (float(moves[k]), [(int(mine[k]), b, room_mb)])
    if theirs.size and mine.size:
        delta = c_h[:, None] - costs[theirs][None, :]  # [n_h, n_b]
        swaps = np.maximum(loads[h] - delta, loads[b] + delta)
        dtok = t_h[:, None] - tokens[theirs][None, :]
        over = ((fill[b, mb_of[theirs]][None, :] + dtok > seq_len)
                | (fill[h, mb_of[mine]][:, None] - dtok > seq_len) | (delta <= 0))
        swaps[over] = np.inf
        k = int(np.argmin(swaps))
        a, x = np.unravel_index(k, swaps.shape)
        if swaps[a, x] < best[0]:
            i, j = int(mine[a]), int(theirs[x])
            best = (float(swaps[a, x]), [(i, b, int(mb_of[j])), (j, h, int(mb_of[i]))])
    return best


def refine_assignment(rank_of, mb_of, costs, tokens, *, dp_size: int, micro_batches: int, seq_len: int,
                      objective: Objective = "sum", tolerance: float = DEFAULT_TOLERANCE,
                      partners: int = DEFAULT_PARTNERS) -> StepPlan:
    """Improve an existing assignment (e.g. the arrival order) with the rank-level polish; every
    micro-batch stays within ``seq_len``. ``"slots"`` plans are returned as they are."""
    start = time.perf_counter()
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    rank_of, mb_of = np.array(rank_of, dtype=np.int64), np.array(mb_of, dtype=np.int64)
    lb = lower_bound(costs, dp_size)
    if objective == "sum":
        _polish_ranks(rank_of, mb_of, costs, tokens, dp_size, micro_batches, seq_len,
                      (1 + tolerance) * lb, partners)
    plan = _make_plan(rank_of, mb_of, costs, tokens, dp_size, micro_batches, objective, lb, 0)
    plan.plan_ms = (time.perf_counter() - start) * 1e3
    plan.stats["plan_ms"] = plan.plan_ms
    return plan


# -------------------------------------------------------------------- micro-batches and slots


def _split_micro_batches(rank_of, costs, tokens, dp, m, seq_len):
    """Worst-fit decreasing (by tokens) of each rank's samples into its m micro-batches, all ranks
    at once; a sample that fits in none of its rank's micro-batches moves to the least-loaded rank
    that has a micro-batch with room (counted as a repair)."""
    n = rank_of.size
    longest = int(tokens.max()) if n else 0
    # By rank, then longest first, ties by index (one stable integer sort).
    order = np.argsort(rank_of * (longest + 1) + (longest - tokens), kind="stable")
    counts = np.bincount(rank_of, minlength=dp)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    position = np.arange(n) - np.repeat(starts, counts)  # rank of each sorted item within its rank
    # Fast path: deal each rank's samples, longest first, over its micro-batches in snake order
    # (0..m-1, m-1..0, ...); keep it for every rank where no micro-batch overflows.
    lap, step = np.divmod(position, m)
    mb_of = np.empty(n, dtype=np.int64)
    mb_of[order] = np.where(lap % 2 == 0, step, m - 1 - step)
    fill = np.bincount(rank_of * m + mb_of, weights=tokens, minlength=dp * m).reshape(dp, m)
    overflowing = (fill > seq_len).any(axis=1)
    if not overflowing.any():
        return rank_of, mb_of, 0
    # Worst-fit decreasing for the other ranks.
    redo = overflowing[rank_of[order]]
    order, position = order[redo], position[redo]
    fill[overflowing] = 0
    fill = fill.astype(np.int64)
    mb_of[order] = -1
    by_position = np.argsort(position, kind="stable")
    levels = int(position.max()) + 1 if order.size else 0
    bounds = np.searchsorted(position[by_position], np.arange(levels + 1))
    order = order[by_position]
    failed = []
    for k in range(levels):
        items = order[bounds[k]:bounds[k + 1]]
        ranks = rank_of[items]
        target = np.argmin(fill[ranks], axis=1)  # most room; ties -> lowest micro-batch index
        ok = fill[ranks, target] + tokens[items] <= seq_len
        mb_of[items[ok]] = target[ok]
        fill[ranks[ok], target[ok]] += tokens[items[ok]]
        failed.extend(items[~ok].tolist())
    rank_loads = np.bincount(rank_of, weights=costs, minlength=dp)
    for i in failed:
        room = (fill + tokens[i] <= seq_len)
        rank_ok = room.any(axis=1)
        if not rank_ok.any():
            raise _NoRoom()
        r = int(np.argmin(np.where(rank_ok, rank_loads, np.inf)))
        mb = int(np.argmin(np.where(room[r], fill[r], np.iinfo(np.int64).max)))
        rank_loads[rank_of[i]] -= costs[i]
        rank_loads[r] += costs[i]
        rank_of[i], mb_of[i] = r, mb
        fill[r, mb] += tokens[i]
    return rank_of, mb_of, len(failed)


def _deal_bins(bin_of, costs, dp, m, objective):
    """Give each rank m of the dp*m bins. "slots": sorted by cost, dp at a time, so slot 0 holds
    the dp costliest bins (this minimises the sum of slot maxima for these bins). "sum": the same
    rounds, but each round's bins go costliest to the rank with the least load so far (LPT with
    one bin per rank per round)."""
    loads = np.bincount(bin_of, weights=costs, minlength=dp * m)
    order = np.lexsort((np.arange(dp * m), -loads))
    slot = np.empty(dp * m, dtype=np.int64)
    rank = np.empty(dp * m, dtype=np.int64)
    slot[order] = np.arange(dp * m) // dp
    if objective == "slots":
        rank[order] = np.arange(dp * m) % dp
    else:
        rank_loads = np.zeros(dp)
        for j in range(m):
            chunk = order[j * dp:(j + 1) * dp]
            lightest = np.argsort(rank_loads, kind="stable")
            rank[chunk] = lightest
            rank_loads[lightest] += loads[chunk]
    return rank[bin_of], slot[bin_of], 0


def _feasible_packing(tokens, bins, capacity) -> np.ndarray:
    """Bin of each sample in a packing that fits: next-fit in input order if it needs at most
    ``bins`` bins, else first-fit decreasing; PlanError when neither fits."""
    bin_of = np.empty(tokens.size, dtype=np.int64)
    current, used = 0, 0
    for i, t in enumerate(tokens.tolist()):
        if used + t > capacity and used > 0:
            current, used = current + 1, 0
        bin_of[i] = current
        used += t
    if tokens.size == 0 or current < bins:
        return bin_of
    fill = np.zeros(bins, dtype=np.int64)
    for i in np.lexsort((np.arange(tokens.size), -tokens)).tolist():
        fits = np.flatnonzero(fill + tokens[i] <= capacity)
        if fits.size == 0:
            raise PlanError(f"the step's {int(tokens.sum())} tokens do not pack into {bins} "
                            f"micro-batches of seq_len={capacity} (sample {i}, {int(tokens[i])} "
                            "tokens, fits nowhere): put fewer samples in the step, or raise seq_len, "
                            "the DP size or the micro-batches per step")
        bin_of[i] = fits[0]
        fill[fits[0]] += tokens[i]
    return bin_of


def _make_plan(rank_of, mb_of, costs, tokens, dp, m, objective, lb, repairs) -> StepPlan:
    flat = rank_of * m + mb_of
    slot_costs = np.bincount(flat, weights=costs, minlength=dp * m).reshape(dp, m)
    slot_tokens = np.bincount(flat, weights=tokens, minlength=dp * m).astype(np.int64).reshape(dp, m)
    stats = plan_stats(slot_costs, costs, objective)
    stats["repairs"] = repairs
    return StepPlan(rank_of=rank_of, micro_batch_of=mb_of,
                    rank_costs=slot_costs.sum(axis=1), slot_costs=slot_costs,
                    slot_tokens=slot_tokens, objective=objective, lower_bound=lb, plan_ms=0.0,
                    repairs=repairs, stats=stats)


def plan_from_assignment(rank_of: np.ndarray, mb_of: np.ndarray, costs: np.ndarray,
                         tokens: np.ndarray, *, dp_size: int, micro_batches: int,
                         objective: str = "sum", plan_ms: float = 0.0) -> StepPlan:
    """A StepPlan for an assignment made elsewhere (the baselines), with the same statistics."""
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    plan = _make_plan(np.asarray(rank_of, dtype=np.int64), np.asarray(mb_of, dtype=np.int64), costs,
                      tokens, dp_size, micro_batches, objective, lower_bound(costs, dp_size), 0)
    plan.plan_ms = plan_ms
    plan.stats["plan_ms"] = plan_ms
    return plan


def exchange_lists(rank_of: Sequence[int] | np.ndarray, owner_rank: Sequence[int] | np.ndarray,
                   dp_size: int) -> list[list[list[int]]]:
    """For exchange mode: ``sends[src][dst]`` are the samples (indices, ascending) that rank ``src``
    holds (``owner_rank[i]``: the rank that loaded sample i) and rank ``dst`` trains
    (``rank_of[i]``, e.g. ``StepPlan.rank_of``). ``sends[r][r]`` stay in place; every rank gets the
    same lists from the same inputs."""
    owner = np.asarray(owner_rank, dtype=np.int64)
    dest = np.asarray(rank_of, dtype=np.int64)
    if owner.shape != dest.shape:
        raise PlanError(f"owner_rank has {owner.size} entries for {dest.size} planned samples")
    for name, values in (("owner_rank", owner), ("rank_of", dest)):
        if values.size and (values.min() < 0 or values.max() >= dp_size):
            raise PlanError(f"{name} values must lie in [0, {dp_size})")
    key = owner * dp_size + dest
    order = np.argsort(key, kind="stable")
    bounds = np.searchsorted(key[order], np.arange(dp_size * dp_size + 1))
    ordered = order.tolist()
    return [[ordered[bounds[s * dp_size + d]:bounds[s * dp_size + d + 1]] for d in range(dp_size)]
            for s in range(dp_size)]
