"""Moving Python objects between ranks on dedicated gloo groups, for the data-loading thread.

Exchange-mode balancing runs its collectives in the data pipeline's background thread while the
main thread runs the model's collectives, so it needs communicators of its own: a collective on a
group shared with the main thread could interleave with the model's and deadlock. ``DataGroups``
holds them; ``build_data_groups`` creates them (every rank must call it, in the main thread, at the
same point, as for any ``new_group``).

Who exchanges: the *leader* of each model-parallel group (tensor rank 0, pipeline rank 0) loads its
data-parallel rank's share and talks to the other leaders over ``exchange``; it then broadcasts the
finished micro-batches over ``replicas`` to the other tensor / pipeline ranks of the same
data-parallel rank, which load nothing. All stages therefore see the same reordered batch.

Objects travel pickled, as uint8 tensors: sizes first, then one ``all_to_all_single`` of the bytes
with per-destination splits (an empty send is a zero-length split, so nobody waits for a message
that never comes).
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class DataGroups:
    """This rank's data-exchange communicators (``None`` where a rank has no part)."""

    is_leader: bool  # loads, exchanges and broadcasts
    exchange: Optional[dist.ProcessGroup]  # the leaders of all DP ranks, in DP-rank order
    replicas: Optional[dist.ProcessGroup]  # this DP rank's leader + its TP/PP peers (TP*PP > 1)
    replicas_src: int = 0  # global rank of the leader within ``replicas``

    @property
    def exchange_size(self) -> int:
        return dist.get_world_size(self.exchange) if self.exchange is not None else 1


def build_data_groups(tp_rank: int, pp_rank: int, dp_rank: int, *, cp_rank: int = 0,
                      timeout: Optional[datetime.timedelta] = None) -> DataGroups:
    """Create the gloo groups for exchange mode from every rank's (tp, pp, dp, cp) coordinates (the
    CP ranks of a DP rank are its leader's peers, like its TP and PP ranks).

    ``timeout`` (``parallel.collective_timeout_s``): how long an exchange waits for a hung rank;
    None keeps torch's default."""
    world = dist.get_world_size()
    coords: list[Any] = [None] * world
    dist.all_gather_object(coords, (tp_rank, pp_rank, dp_rank, cp_rank))
    leaders = sorted((c[2], rank) for rank, c in enumerate(coords) if c[0] == 0 and c[1] == 0 and c[3] == 0)
    me = dist.get_rank()
    exchange_group = dist.new_group([rank for _, rank in leaders], backend="gloo", timeout=timeout)
    is_leader = tp_rank == 0 and pp_rank == 0 and cp_rank == 0
    replicas, replicas_src = None, me
    if world > len(leaders):  # TP*PP*CP > 1: one replica group per DP rank, all ranks create each
        for dp, leader in leaders:
            members = [leader] + sorted(r for r, c in enumerate(coords) if c[2] == dp and r != leader)
            group = dist.new_group(members, backend="gloo", timeout=timeout)
            if dp == dp_rank:
                replicas, replicas_src = group, leader
    return DataGroups(is_leader=is_leader, exchange=exchange_group if is_leader else None,
                      replicas=replicas, replicas_src=replicas_src)


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Every member's ``obj``, in group-rank order (``[obj]`` without a group)."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def exchange_objects(sends: Sequence[Any], group: Optional[dist.ProcessGroup]) -> list[Any]:
    """All-to-all of Python objects: ``sends[d]`` goes to group rank ``d``; returns what each group
    rank sent here (``recv[s]``). ``None`` entries travel as zero bytes and arrive as ``None``."""
    if group is None:
        return list(sends)
    size = dist.get_world_size(group)
    if len(sends) != size:
        raise ValueError(f"{len(sends)} sends for a group of {size} ranks")
    payloads = [b"" if obj is None else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) for obj in sends]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)  # [size]
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = torch.from_numpy(np.frombuffer(b"".join(payloads), dtype=np.uint8).copy())  # [sum send]
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)  # [sum recv]
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes.tolist(),
                           input_split_sizes=send_sizes.tolist(), group=group)
    received, offset = [], 0
    buffer = recv.numpy().tobytes()
    for n in recv_sizes.tolist():
        received.append(pickle.loads(buffer[offset:offset + n]) if n else None)
        offset += n
    return received


def broadcast_object(obj: Any, src: int, group: Optional[dist.ProcessGroup]) -> Any:
    """``obj`` from global rank ``src`` to every member of ``group`` (identity without a group)."""
    if group is None:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
