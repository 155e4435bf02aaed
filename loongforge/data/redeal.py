"""A sharded read's position, dealt again to another data-parallel size (``data.read=sharded``).

Shard ``(i, n)`` reads positions ``i, i+n, i+2n, ...`` of each epoch's order, so a checkpoint holds
one position per shard: its epoch, its cursor (next position to read), the positions it read but
has not trained yet (the packer's buffer) and any positions dealt to it by an earlier re-deal that
it has not read yet. Resuming with ``m`` shards instead of ``n``, every rank gathers all ``n``
saved positions, lists for each unfinished epoch the positions no old shard trained (in epoch
order), and new shard ``k`` reads ``remaining[k::m]`` of them first; after those it reads its
regular share from the epoch after the latest one any old shard had begun. Every sample of an
epoch is trained exactly once across the restart, whichever epochs the old shards stood in.

Worked example: 10 samples, 2 shards. Shard 0 stands at (epoch 0, cursor 4), buffer [(0, 2)];
shard 1 at (epoch 0, cursor 9), buffer []. Untrained in epoch 0: 2, 4, 6, 8 (shard 0) and 9
(shard 1), so [2, 4, 6, 8, 9]. At 3 shards: shard 0 reads 2, 8 then epoch 1 from 0; shard 1 reads
4, 9 then epoch 1 from 1; shard 2 reads 6 then epoch 1 from 2.

A long document cut into pieces (``measure.document_pieces``) is read at one position but trained
piece by piece: a shard standing inside one holds ``[epoch, position, piece]`` keys (buffered, or
``pieces`` still to come). Its untrained pieces are dealt as a whole (``dealt_pieces``: ``[epoch,
position, [piece, ...]]``), so a new shard trains exactly those pieces of it.

Pure: no torch, no I/O (numpy for the position lists). States are the JSON-ready dicts ``RowStream.state_dict`` returns.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Optional

import numpy as np


def _shard(state: dict) -> tuple[int, int]:
    index, count = state["shard"]
    return int(index), int(count)


def untrained_positions(states: list[dict], epoch_size: int) -> dict[int, list[int]]:
    """Epoch -> the sorted positions of that epoch that no shard has trained, for every epoch up to
    the latest one any shard has begun. ``states``: one per old shard (any order)."""
    if epoch_size < 1:
        raise ValueError(f"epoch_size must be >= 1, got {epoch_size}")
    last = max(int(s["epoch"]) for s in states)
    pieces: dict[int, list[np.ndarray]] = {}
    for state in states:
        index, count = _shard(state)
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        pieces.setdefault(epoch, []).append(np.arange(cursor, epoch_size, count))  # its regular share left
        for later in range(epoch + 1, last + 1):
            pieces.setdefault(later, []).append(np.arange(index, epoch_size, count))
        for e, p in (key for key in state["buffer"] if len(key) == 2):  # pieces: untrained_pieces
            pieces.setdefault(int(e), []).append(np.array([int(p)]))
        for e, dealt in state.get("dealt", []):
            pieces.setdefault(int(e), []).append(np.asarray(dealt, dtype=np.int64))
    remaining = {}
    for epoch in sorted(pieces):
        positions = np.sort(np.concatenate(pieces[epoch]))
        repeated = positions[1:][positions[1:] == positions[:-1]]
        if len(repeated):  # two shards claim one position: the states are not one run's
            raise ValueError(f"epoch {epoch} positions {sorted(set(repeated.tolist()))[:5]} are untrained in "
                             "more than one shard's saved position")
        if len(positions):
            remaining[epoch] = positions.tolist()
    return remaining


def untrained_pieces(states: list[dict]) -> list[list]:
    """``[epoch, position, [piece, ...]]`` per long document cut into pieces (``[epoch, position,
    piece]`` keys) that a shard stood inside: the pieces no shard trained (buffered, still to come,
    or dealt by an earlier re-deal and not read yet), documents in (epoch, position) order. Not a
    suffix of the pieces in general: the packer may take a short last piece before a full one."""
    by_document: dict[tuple[int, int], list[int]] = {}
    for state in states:
        for key in (*state["buffer"], *state.get("pieces", [])):
            if len(key) == 3:
                by_document.setdefault((int(key[0]), int(key[1])), []).append(int(key[2]))
        for epoch, position, wanted in state.get("dealt_pieces", []):
            by_document.setdefault((int(epoch), int(position)), []).extend(map(int, wanted))
    return [[epoch, position, sorted(wanted)] for (epoch, position), wanted in sorted(by_document.items())]


def redeal(states: list[dict], count: int, epoch_size: int) -> list[dict]:
    """The ``count`` new shards' stream states (index order) that continue the ``states`` of the
    old shards exactly: see the module docstring."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    indices = sorted(_shard(s) for s in states)
    old_count = indices[0][1]
    if indices != [(i, old_count) for i in range(old_count)]:
        raise ValueError(f"the saved positions are of shards {indices}, not one each of 0..{old_count - 1}")
    remaining = untrained_positions(states, epoch_size)
    documents = untrained_pieces(states)
    next_epoch = max(int(s["epoch"]) for s in states) + 1
    new_states = []
    for k in range(count):
        dealt = [[epoch, positions[k::count]] for epoch, positions in remaining.items() if positions[k::count]]
        mine = {"dealt_pieces": documents[k::count]} if documents[k::count] else {}
        new_states.append({"epoch": next_epoch, "cursor": k, "buffer": [], "shard": [k, count], "dealt": dealt,
                           **mine})
    return new_states


def merged_rejects(states: list[dict]) -> dict:
    """One RejectLog state from every old rank's (each counted a reject once; the union, counted
    again, counts each once)."""
    seen = sorted({tuple(entry) for state in states for entry in state["seen"]})
    counts = Counter(entry[2] for entry in seen)
    return {"seen": [list(entry) for entry in seen], "counts": dict(counts)}


class DealtPositions:
    """The positions a re-deal gave one shard, read before its regular share: ``pop`` hands them
    out in epoch order, ``state`` is what is left (as ``redeal`` writes it)."""

    def __init__(self, dealt: Optional[list] = None):
        self._epochs = deque((int(epoch), deque(int(p) for p in positions)) for epoch, positions in dealt or [])

    def __bool__(self) -> bool:
        return any(positions for _, positions in self._epochs)

    def pop(self) -> Optional[tuple[int, int]]:
        """The next (epoch, position), or None when all were read."""
        while self._epochs:
            epoch, positions = self._epochs[0]
            if positions:
                return epoch, positions.popleft()
            self._epochs.popleft()
        return None

    def first(self) -> list[tuple[int, int]]:
        """The next position of each epoch (where a reader must be able to seek to)."""
        return [(epoch, positions[0]) for epoch, positions in self._epochs if positions]

    def state(self) -> list:
        return [[epoch, list(positions)] for epoch, positions in self._epochs if positions]
