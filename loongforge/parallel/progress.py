"""Which rank did not arrive: after a collective timeout, the ranks that did not time out themselves.

A collective that times out on gloo says only "Timed out waiting 600000ms for recv operation"; it
names no rank, and the group is unusable afterwards (a ``monitored_barrier`` then fails too). When
one rank hangs, every other rank ends up waiting for it, directly or through a rank that waits for
it, and times out within about a step of the first. The key-value store the process group was
created with (``MASTER_ADDR:MASTER_PORT``, or torch elastic's agent store) still works: each rank
that times out writes its step there and, for a short while, reads which ranks have not: those are
the hung ones. Nothing is written while the run is healthy.
"""

from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

_KEY = "loongforge/timed_out/{rank}"


class RankProgress:
    def __init__(self, store: Optional[dist.Store], rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.step = 0  # the step this rank is in (local only: no store traffic per step)

    @classmethod
    def of_default_group(cls) -> "RankProgress":
        """Progress over the default group's store; inert for a world of one (nobody to wait for)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return cls(None, 0, 1)
        # torch has no public accessor for the store a group was initialised with.
        store = dist.distributed_c10d._get_default_store()
        return cls(store, dist.get_rank(), dist.get_world_size())

    def begin_step(self, step: int) -> None:
        self.step = step

    def _timed_out_ranks(self) -> dict[int, int]:
        """rank -> step, for the ranks that reported a timeout (``check`` first: ``get`` of a
        missing key would block for the store's whole timeout)."""
        keys = {rank: _KEY.format(rank=rank) for rank in range(self.world_size)}
        return {rank: int(self.store.get(key)) for rank, key in keys.items() if self.store.check([key])}

    def name_hung_ranks(self, wait_s: float) -> str:
        """Report this rank's timeout, wait up to ``wait_s`` for the others' and name the ranks that
        never reported one; a clause for an error message ("" for a world of one)."""
        if self.store is None:
            return ""
        try:
            self.store.set(_KEY.format(rank=self.rank), str(self.step))
            deadline = time.monotonic() + wait_s
            reported = self._timed_out_ranks()
            while len(reported) < self.world_size and time.monotonic() < deadline:
                time.sleep(0.2)
                reported = self._timed_out_ranks()
        except (RuntimeError, ValueError) as exc:  # the store is gone too (its host died)
            return f"which rank hung is unknown ({exc})"
        hung = [rank for rank in range(self.world_size) if rank not in reported]
        if not hung:
            return "every rank timed out waiting (a lost connection rather than a hung rank?)"
        return ("did not arrive (hung, not waiting for others): "
                + ", ".join(f"rank {rank}" for rank in hung))
