"""Exchange-mode balancing: each data-parallel rank loaded only its own share of the step.

With ``data.read=sharded`` no rank knows the other ranks' samples in advance, so per step the
leaders (one per data-parallel rank, see ``loongforge.parallel.data_groups``):
1. all-gather their samples' sizes (``SampleSize``: length and vision patches, a few bytes each)
   and the rejects they found since the last step (so every rank counts every reject once);
2. each compute the same ``StepBalancer`` decision from the gathered sizes, rank 0's rows first;
3. if the decision is applied, send each materialised sample (token ids, pixels) to the rank that
   trains it with one all-to-all; otherwise nothing moves and each rank trains its own rows.

All of it runs in the data-loading thread on a dedicated gloo group, so it overlaps the previous
step's compute. Samples of step ``s`` only ever move within step ``s``: the multiset of samples a
step trains is the union of the ranks' shares whether or not balancing applies.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from loongforge.balance.apply import BalanceDecision, StepBalancer, sample_size
from loongforge.balance.planner import exchange_lists
from loongforge.data.measure import MaterializedSample
from loongforge.data.samples import Reject
from loongforge.parallel.data_groups import all_gather_objects, exchange_objects


class SampleExchange:
    """One leader's side of the per-step exchange; ``group`` holds the leaders in DP-rank order."""

    def __init__(self, group, *, dp_rank: int, dp_size: int, balancer: Optional[StepBalancer]):
        self.group = group
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.balancer = balancer

    def run(self, rows: list[list[MaterializedSample]], new_rejects: list[Reject]
            ) -> tuple[list[list[MaterializedSample]], Optional[BalanceDecision], list[Reject]]:
        """``rows``: this rank's materialised rows for the step, one per micro-batch. Returns the
        micro-batches this rank trains, the decision (None without a balancer) and every rank's
        new rejects."""
        sizes = [[sample_size(m.sample) for m in row] for row in rows]
        gathered = all_gather_objects((sizes, new_rejects), self.group)
        rejects = [reject for _, rank_rejects in gathered for reject in rank_rejects]
        if self.balancer is None:
            return rows, None, rejects
        decision = self.balancer.decide([row for rank_sizes, _ in gathered for row in rank_sizes])
        if not decision.applied:  # the arrival assignment: this rank's own rows, in order
            return rows, decision, rejects
        return self._move(rows, gathered, decision), decision, rejects

    def _move(self, rows, gathered, decision: BalanceDecision) -> list[list[MaterializedSample]]:
        per_rank = [sum(len(row) for row in rank_sizes) for rank_sizes, _ in gathered]
        owner = np.repeat(np.arange(self.dp_size), per_rank)  # [samples in the step]
        first = int(sum(per_rank[:self.dp_rank]))  # step-wide index of this rank's first sample
        rank_of = np.empty(len(owner), dtype=np.int64)
        for rank, micro_batches in enumerate(decision.micro_batches):
            for mb in micro_batches:
                rank_of[mb] = rank
        mine = [m for row in rows for m in row]
        sends = exchange_lists(rank_of, owner, self.dp_size)[self.dp_rank]
        kept = {i: mine[i - first] for i in sends[self.dp_rank]}
        payloads = [[(i, mine[i - first]) for i in indices] if indices and dst != self.dp_rank else None
                    for dst, indices in enumerate(sends)]  # what stays here is not pickled
        received = {i: m for batch in exchange_objects(payloads, self.group) if batch for i, m in batch}
        received.update(kept)
        return [[received[i] for i in mb] for mb in decision.micro_batches[self.dp_rank]]
