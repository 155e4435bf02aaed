"""Online packing of variable-length samples into rows, and the split of rows over ranks.

Pure algorithms: no torch, no torch.distributed. Every data-parallel rank runs the same packer
over the same sample stream, so all ranks agree on the global row stream without talking.

Packing is first-fit over a lookahead buffer: a row starts with the oldest buffered sample (so no
sample waits forever), then takes, in buffer order, every buffered sample that still fits; the
buffer is topped up to ``lookahead`` samples and scanned again until a pass takes nothing. The
result is a deterministic function of the stream and the buffer contents, which is all a
checkpoint needs to store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Hashable, Optional, TypeVar

Payload = TypeVar("Payload")


@dataclass
class PackItem(Generic[Payload]):
    key: Hashable  # stable identity for checkpoints (e.g. (epoch, position) in the stream)
    length: int  # tokens
    payload: Payload = None


def padded_length(length: int, sample_multiple: int) -> int:
    """Tokens a sample of ``length`` takes in a row whose samples are padded to ``sample_multiple``
    (2 x CP under context parallelism, ``config.layout.sample_multiple``)."""
    return -(-length // sample_multiple) * sample_multiple


class LookaheadPacker(Generic[Payload]):
    def __init__(self, seq_len: int, lookahead: int, sample_multiple: int = 1):
        """``sample_multiple``: every sample takes its length rounded up to this in the row (the
        collate pads it so)."""
        if seq_len < 1 or lookahead < 1 or sample_multiple < 1:
            raise ValueError(f"seq_len, lookahead and sample_multiple must be >= 1, got {seq_len}, {lookahead}, "
                             f"{sample_multiple}")
        self.seq_len = seq_len
        self.lookahead = lookahead
        self.sample_multiple = sample_multiple
        self.buffer: list[PackItem[Payload]] = []

    def footprint(self, item: PackItem) -> int:
        return padded_length(item.length, self.sample_multiple)

    def next_row(self, pull: Callable[[], Optional[PackItem[Payload]]]) -> list[PackItem[Payload]]:
        """The next row; ``pull`` returns the next stream item, or None when the stream ended.
        Returns [] only when the stream ended and the buffer is empty."""
        self._refill(pull)
        if not self.buffer:
            return []
        row = [self.buffer.pop(0)]
        free = self.seq_len - self.footprint(row[0])
        # Items taken from the buffer free slots; refilled slots get a chance in the next pass, so
        # rows of many short samples fill up instead of stopping at `lookahead` samples.
        while free > 0:
            self._refill(pull)
            taken = []
            for item in self.buffer:
                if self.footprint(item) <= free:
                    taken.append(item)
                    free -= self.footprint(item)
            if not taken:
                break
            row.extend(taken)
            taken_ids = {id(item) for item in taken}
            self.buffer = [item for item in self.buffer if id(item) not in taken_ids]
        return row

    def _refill(self, pull: Callable[[], Optional[PackItem[Payload]]]) -> None:
        while len(self.buffer) < self.lookahead:
            item = pull()
            if item is None:
                return
            if self.footprint(item) > self.seq_len:
                raise ValueError(f"item {item.key} takes {self.footprint(item)} tokens > seq_len {self.seq_len}")
            self.buffer.append(item)

    def buffer_keys(self) -> list[Any]:
        return [item.key for item in self.buffer]


def pack_lengths(lengths: list[int], seq_len: int, lookahead: int) -> list[list[int]]:
    """Pack a finite list; returns rows of indices into ``lengths`` (for tests and planning)."""
    packer: LookaheadPacker[None] = LookaheadPacker(seq_len, lookahead)
    stream = iter(PackItem(key=i, length=n) for i, n in enumerate(lengths))
    rows = []
    while row := packer.next_row(lambda: next(stream, None)):
        rows.append([item.key for item in row])
    return rows


def rank_rows(global_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Indices, within one step's ``global_batch_size`` rows, that DP rank ``dp_rank`` trains on:
    a contiguous block, so the union over ranks in rank order is the step's rows in order."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
    if global_batch_size % dp_size:
        raise ValueError(
            f"training.global_batch_size={global_batch_size} is not divisible by data-parallel size {dp_size}"
        )
    per_rank = global_batch_size // dp_size
    return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
