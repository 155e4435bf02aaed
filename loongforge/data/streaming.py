"""``data.streaming=true``: read the data sources front to back, never copying or indexing them.

For inputs too large to copy into the Arrow cache. The stream is the records of ``data.paths`` (the
same records, lines and rejects as ``ArrowSamples``) with the entries mixed: each next record comes
from the entry furthest behind its share, shares in proportion to the entries' bytes on disk, so
``data.paths=[coco.jsonl, math.jsonl]`` trains both all through the epoch, not all of COCO first
(within an entry, a folder's files follow one another). With ``path@weight`` entries
(``loongforge.data.mixture``) the shares are the weights, an entry that runs out starts again from
its first record, and the epoch ends once every entry has been read through. The stream is cut into windows of
``data.shuffle_window`` records; with ``data.shuffle`` each window is visited in a permutation drawn
from (data.seed, epoch, window), so memory holds a window, not the data, and any position of the
stream is found again from where its window starts. Positions are dealt to data-parallel shards
as in ``RowStream`` (shard ``i`` of ``n`` takes positions i, i+n, ...; every rank reads the raw
records, each decodes and measures only its own).

Exact resume: a checkpoint holds the stream position (epoch, cursor), the packer's buffered
positions and where the windows holding them start (for each entry: records taken, and source,
byte offset or row, line of its next record), so a resumed run seeks there and continues with the
same samples.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

import numpy as np
import pyarrow.parquet as pq

from loongforge.config.errors import InputError
from loongforge.data.arrow_samples import load_saved_dataset, open_hub_dataset
from loongforge.data.conversations import (
    DEFAULT_READING,
    HUB_PREFIX,
    entry_groups,
    expand_data_paths,
    is_saved_dataset,
    parse_record,
    read_data_file,
    read_json_record,
    read_record,
    reading_of,
    text_line_record,
)
from loongforge.data.measure import MeasuredSample, document_pieces
from loongforge.data.mixture import (
    SourceCounts,
    all_rejected_error,
    check_none_empty,
    check_same_weights,
    counts_report,
    entry_weights,
    redealt_counts,
    source_names,
)
from loongforge.data.packing import PackItem
from loongforge.data.redeal import DealtPositions, redeal
from loongforge.data.record_kinds import RecordReading
from loongforge.data.samples import Reject
from loongforge.data.samples import Sample as RecordSample

if TYPE_CHECKING:
    import datasets

# Where a record starts: (source index, byte offset (JSON lines, .txt) or record index (others), line).
Location = tuple[int, int, int]
Sample = Union[RecordSample, Reject]
_WINDOWS_KEPT = 4  # decoded windows kept in memory: the packer looks back at most a few


class _Entry:
    """One record as read, parsed into a sample only when its shard asks for it. ``group``: the
    data.paths entry it came from, ``passes``: the passes over that entry ended before it in its
    epoch (both set by the reader that mixes them)."""

    __slots__ = ("parse", "group", "passes")

    def __init__(self, parse: Callable[[], Sample]):
        self.parse = parse
        self.group = 0
        self.passes = 0


def _line_entries(path: Path, start: Location, reading: RecordReading) -> Iterator[tuple[Location, _Entry]]:
    """The records of a JSON lines or .txt file (one a non-empty line), from a byte offset."""
    source, offset, line = start
    name, root = str(path), path.parent
    with open(path, "rb") as f:
        f.seek(offset)
        for raw in iter(f.readline, b""):
            here = (source, offset, line)
            offset, line = offset + len(raw), line + 1
            if not raw.strip():
                continue
            if path.suffix == ".txt":
                yield here, _Entry(lambda raw=raw, line=here[2]: _text_line_sample(raw, line, path, reading))
            else:  # a record per line: its ordinal is its line - 1 (conversations._Located)
                yield here, _Entry(lambda raw=raw, line=here[2]: read_json_record(
                    raw, file=name, line=line, ordinal=line - 1, media_root=root, reading=reading))


def _text_line_sample(raw: bytes, line: int, path: Path, reading: RecordReading) -> Sample:
    entry = text_line_record(line, raw)[0]
    return read_record(entry.record, entry.error, file=str(path), line=line, ordinal=entry.ordinal,
                       media_root=path.parent, reading=reading)


def _json_entries(path: Path, located, start: Location, reading: RecordReading) -> Iterator[tuple[Location, _Entry]]:
    """A .json file is parsed whole (a JSON list has no record boundaries to seek to)."""
    source, first, _ = start
    for index in range(first, len(located)):
        entry = located[index]
        yield (source, index, entry.line), _Entry(lambda e=entry: read_record(
            e.record, e.error, file=str(path), line=e.line, ordinal=e.ordinal, media_root=path.parent,
            reading=reading))


def _table_entries(rows: Iterator[dict], name: str, media_root: Path, start: Location, reading: RecordReading):
    source, first, _ = start
    for index, record in enumerate(rows, start=first):
        yield (source, index, index + 1), _Entry(lambda r=record, row=index: parse_record(
            r, file=name, line=row + 1, ordinal=row, media_root=media_root, reading=reading))


def _parquet_rows(path: Path, first: int) -> Iterator[dict]:
    parquet = pq.ParquetFile(path)
    skipped = 0
    for group in range(parquet.num_row_groups):
        size = parquet.metadata.row_group(group).num_rows
        if skipped + size <= first:
            skipped += size
            continue
        table = parquet.read_row_group(group).replace_schema_metadata(None)
        yield from table.slice(max(0, first - skipped)).to_pylist()
        skipped += size


def _dataset_rows(rows: datasets.Dataset, first: int) -> Iterator[dict]:
    table = rows.with_format("arrow")
    for start in range(first, rows.num_rows, 1024):
        yield from table[start:start + 1024].to_pylist()


# Where the mixed stream stands: per data.paths entry, how many of its records were taken, where
# its next record starts (None once it is used up) and, with weights, how many passes over it ended.
MixLocation = tuple[tuple, ...]  # per entry (taken, location) or (taken, location, passes)


def _byte_weights(sources: list[str], groups: list[range]) -> list[int]:
    """Each entry's share of the mix without ``@weight``s: its bytes on disk when every source is a
    local file (records are about proportional to them), else equal shares (a hub dataset's size
    is not at hand)."""
    if not all(Path(source).is_file() for source in sources):
        return [1] * len(groups)
    return [max(1, sum(Path(sources[i]).stat().st_size for i in group)) for group in groups]


class _Sources:
    """The records of ``data.paths``, the entries mixed (``_MixedReader``), readable from any
    MixLocation. Within an entry (a folder's files) records follow the entry's order."""

    def __init__(self, paths: list[str], reading: RecordReading = DEFAULT_READING):
        self.sources = expand_data_paths(paths)
        self.reading = reading
        weights = entry_weights(list(paths))
        # With @weights an entry that runs out starts its next pass (loongforge.data.mixture); the
        # stream's epoch ends once every entry has ended a pass, so no record is left unread.
        self.restarts = weights is not None
        self.mix_weights = weights  # None: the byte shares below
        groups = entry_groups(list(paths))
        if self.restarts:
            check_none_empty(list(paths), [len(group) for group in groups])
        self.names = [name for name, group in zip(source_names(list(paths)), groups) if len(group)]
        self.groups = [group for group in groups if len(group)]
        self.weights = weights or _byte_weights(self.sources, self.groups)
        self._group_of = {source: g for g, group in enumerate(self.groups) for source in group}
        # With @weights, per entry whose first pass was read through: its records, and the position
        # (in an epoch's reading order, before window shuffling) of the last one. The same every epoch.
        self.first_pass: dict[int, tuple[int, int]] = {}
        self._opened: dict[int, object] = {}  # per entry, its latest parsed .json file or opened dataset

    def start(self) -> MixLocation:
        passes = (0,) if self.restarts else ()
        return tuple((0, self.group_start(g), *passes) for g in range(len(self.groups)))

    def group_start(self, group: int) -> Location:
        return (self.groups[group].start, 0, 1)

    def reader(self, start: MixLocation) -> _MixedReader:
        return _MixedReader(self, start)

    def group_entries(self, group: int, start: Location) -> Iterator[tuple[Location, _Entry]]:
        for source in range(start[0], self.groups[group].stop):
            first = start if source == start[0] else (source, 0, 1)
            yield from self._source_entries(source, first)

    def _source_entries(self, source: int, start: Location):
        name = self.sources[source]
        path = Path(name)
        reading = reading_of(path, self.reading)
        if path.suffix in (".jsonl", ".txt") and path.is_file():
            return _line_entries(path, start, reading)
        if path.suffix == ".parquet" and path.is_file():
            return _table_entries(_parquet_rows(path, start[1]), name, path.parent, start, reading)
        opened = self._open(source)
        if isinstance(opened, list):  # a parsed .json file, else an opened dataset
            return _json_entries(path, opened, start, reading)
        media_root = path if path.is_dir() else Path.cwd()
        return _table_entries(_dataset_rows(opened, start[1]), name, media_root, start, reading)

    def _open(self, source: int):
        """Parse a .json file or open a dataset once, not once per window."""
        if source not in self._opened:
            group = self._group_of[source]  # one per entry: each entry's stream moves forward
            self._opened = {s: o for s, o in self._opened.items() if self._group_of[s] != group}
            name = self.sources[source]
            if name.startswith(HUB_PREFIX):
                self._opened[source] = open_hub_dataset(name)
            elif Path(name).is_dir() and is_saved_dataset(Path(name)):
                self._opened[source] = load_saved_dataset(Path(name))
            else:
                self._opened[source] = read_data_file(Path(name))
        return self._opened[source]

    def location_json(self, location: MixLocation) -> list:
        return [[taken, list(at) if at is not None else None, *passes] for taken, at, *passes in location]

    def location_from_json(self, value: list) -> MixLocation:
        if len(value) == 3 and all(isinstance(v, int) for v in value):  # saved reading entries in turn
            if len(self.groups) > 1:
                raise InputError("the checkpoint's streamed position was saved reading the data.paths entries "
                                 "one after another (loongforge before issue 30); this one mixes them: resume "
                                 "it with the loongforge that saved it, or start without it")
            return ((0, tuple(value)),)
        if any((len(entry) == 3) != self.restarts for entry in value):
            raise InputError("the checkpoint's streamed position was saved with other data.paths weights (or "
                             "none); resume with the data.paths it was saved with")
        return tuple((int(taken), tuple(at) if at is not None else None, *map(int, passes))
                     for taken, at, *passes in value)


class _MixedReader:
    """The records of every data.paths entry, mixed: each next record comes from the entry
    furthest behind its share (``_Sources.weights``) of the records taken so far, ties to the
    first (the rule of ``mixture.draw_pattern``); a used-up entry drops out, or with @weights starts
    its next pass (``_end_pass``). A function of the MixLocation alone, so any window is found
    again from where it starts. Two equal entries alternate; coco.jsonl at 9x math.jsonl's bytes
    gives 9 COCO records, then a math one, and so on."""

    def __init__(self, sources: _Sources, start: MixLocation):
        self._sources = sources
        self._weights, self._total_weight = sources.weights, sum(sources.weights)
        self._taken = [taken for taken, *_ in start]
        self._passes = [passes[0] if passes else 0 for _, _, *passes in start]
        self._iters = [sources.group_entries(g, at) if at is not None else iter(())
                       for g, (_, at, *_) in enumerate(start)]
        self._next = [next(it, None) for it in self._iters]  # each entry's next (location, entry)

    def __iter__(self) -> _MixedReader:
        return self

    def __next__(self) -> _Entry:
        live = [g for g, peeked in enumerate(self._next) if peeked is not None]
        if not live:
            raise StopIteration
        count = sum(self._taken) + 1
        g = max(live, key=lambda g: (count * self._weights[g] - self._taken[g] * self._total_weight, -g))
        _, entry = self._next[g]
        entry.group, entry.passes = g, self._passes[g]
        self._next[g] = next(self._iters[g], None)
        self._taken[g] += 1
        if self._next[g] is None and self._sources.restarts:
            self._end_pass(g)
        return entry

    def _end_pass(self, g: int) -> None:
        """Entry ``g`` ran out: the stream's epoch ends if every entry has ended a pass (the rest
        of a repeat pass is not needed), else ``g`` starts again from its first record."""
        if self._passes[g] == 0:
            self._sources.first_pass.setdefault(g, (self._taken[g], sum(self._taken) - 1))
        self._passes[g] += 1
        if min(self._passes) >= 1:
            self._next = [None] * len(self._next)
            return
        self._iters[g] = self._sources.group_entries(g, self._sources.group_start(g))
        self._next[g] = next(self._iters[g], None)

    def has_next(self) -> bool:
        return any(peeked is not None for peeked in self._next)

    def location(self) -> MixLocation:
        """Where the next record starts."""
        passes = [(p,) if self._sources.restarts else () for p in self._passes]
        return tuple((taken, peeked[0] if peeked is not None else None, *extra)
                     for taken, peeked, extra in zip(self._taken, self._next, passes))


class StreamingSamples:
    """Records by (epoch, position): position ``p`` is entry ``p % W`` of window ``p // W`` (of
    ``W`` = ``window`` records, in its epoch's permutation when shuffling). ``get`` returns None past
    the end of the data."""

    def __init__(self, paths: list[str], *, window: int, shuffle: bool, seed: int,
                 reading: RecordReading = DEFAULT_READING):
        if window < 1:
            raise ValueError(f"data.shuffle_window must be >= 1, got {window}")
        self._sources = _Sources(paths, reading)
        self.window, self.shuffle, self.seed = window, shuffle, seed
        self.starts: dict[int, MixLocation] = {0: self._sources.start()}  # window -> where its first record is
        self.num_windows: Optional[int] = None  # known once the end was read
        self._windows: OrderedDict[tuple[int, int], list[_Entry]] = OrderedDict()

    def get(self, epoch: int, position: int) -> Optional[Sample]:
        window, offset = divmod(position, self.window)
        entries = self._entries(epoch, window)
        return entries[offset].parse() if offset < len(entries) else None

    @property
    def weights(self) -> Optional[list[int]]:
        """The data.paths entries' @weights as whole numbers; None when they mix by bytes."""
        return self._sources.mix_weights

    @property
    def source_names(self) -> list[str]:
        """The data.paths entries (their paths) whose records the stream mixes, in order."""
        return self._sources.names

    def source_of(self, epoch: int, position: int) -> int:
        """Which data.paths entry (index into ``source_names``) the record at a position came from."""
        window, offset = divmod(position, self.window)
        return self._entries(epoch, window)[offset].group

    def origin(self, epoch: int, position: int) -> Optional[tuple[int, int]]:
        """(entry, passes over it ended before this record in its epoch) of the record at a
        position; None past the end."""
        window, offset = divmod(position, self.window)
        entries = self._entries(epoch, window)
        return (entries[offset].group, entries[offset].passes) if offset < len(entries) else None

    @property
    def first_pass(self) -> dict[int, tuple[int, int]]:
        """With @weights, per entry read through once so far: (its records, the epoch position of
        its last one before window shuffling)."""
        return self._sources.first_pass

    def first_pass_json(self) -> dict:
        return {str(g): list(value) for g, value in sorted(self._sources.first_pass.items())}

    def load_first_pass(self, value: dict) -> None:
        self._sources.first_pass.update({int(g): (int(n), int(last)) for g, (n, last) in value.items()})

    def _entries(self, epoch: int, window: int) -> list[_Entry]:
        key = (epoch, window)
        if key not in self._windows:
            entries = self._read_window(window)
            if self.shuffle and entries:
                order = np.random.default_rng([self.seed, epoch, window]).permutation(len(entries))
                entries = [entries[i] for i in order]
            self._windows[key] = entries
            while len(self._windows) > _WINDOWS_KEPT:
                self._windows.popitem(last=False)
        return self._windows[key]

    def _read_window(self, window: int) -> list[_Entry]:
        if self.num_windows is not None and window >= self.num_windows:
            return []
        known = max(k for k in self.starts if k <= window)
        while known < window:  # read forward to find where `window` starts
            self._read_from(known)
            known += 1
            if known not in self.starts:
                return []
        return self._read_from(window)

    def _read_from(self, window: int) -> list[_Entry]:
        reader = self._sources.reader(self.starts[window])
        entries: list[_Entry] = []
        for entry in reader:
            entries.append(entry)
            if len(entries) == self.window:
                break
        if len(entries) == self.window and reader.has_next():
            self.starts[window + 1] = reader.location()
            return entries
        self.num_windows = window + (1 if entries else 0)
        return entries

    def record_count(self) -> int:
        """Records an epoch has; reads forward from the furthest window start known (a pass over
        the rest of the data the first time: a resume at another DP size needs it)."""
        window = max(self.starts)
        while True:
            entries = self._read_from(window)
            if self.num_windows is not None:
                return window * self.window + len(entries)
            window += 1

    def state_for(self, positions: list[int]) -> dict:
        """Window starts a reader needs to find ``positions`` again (JSON-serialisable): for each
        position's window, the nearest start known at or below it (reading resumes from there)."""
        needed = {max(k for k in self.starts if k <= p // self.window) for p in positions}
        return {str(k): self._sources.location_json(self.starts[k]) for k in sorted(needed)}

    def load_starts(self, starts: dict) -> None:
        for window, location in starts.items():
            self.starts[int(window)] = self._sources.location_from_json(location)
        self._windows.clear()


class StreamingRowStream:
    """``RowStream``'s contract (``next_row``, ``state_dict``) over a ``StreamingSamples``."""

    def __init__(self, source: StreamingSamples, measurer, *, packer, rejects, shard: tuple[int, int]):
        self.source, self.measurer, self.packer, self.rejects = source, measurer, packer, rejects
        # With @weights: samples and tokens trained, records rejected, per data.paths entry
        # (loongforge.data.mixture).
        self.counts = SourceCounts(source.source_names, rejected=True) if source.weights is not None else None
        # With @weights: the entries known to hold a usable record (``_check_first_passes``), and
        # those whose first-pass records this stream accepted.
        self._usable: set[int] = set()
        self._accepted_first_pass: set[int] = set()
        self.shard_index, self.shard_count = shard
        self.epoch, self.cursor = 0, self.shard_index
        self.dealt = DealtPositions()  # read first: what a resume at another DP size dealt this shard
        self.pieces: list[PackItem[MeasuredSample]] = []  # a long document's pieces still to pull
        self.dealt_pieces: deque = deque()  # [epoch, position, pieces] a re-deal gave this shard
        self._accepted_this_epoch = False
        self._rejected_this_epoch: Counter = Counter()

    def next_row(self) -> list[PackItem[MeasuredSample]]:
        row = self.packer.next_row(self._pull)
        if self.counts is not None:
            for item in row:
                self.counts.add(self.source.source_of(item.key[0], item.key[1]), item.key, item.length)
        return row

    def source_report(self, counts: Optional[dict] = None) -> Optional[dict]:
        """Per data.paths entry: samples and tokens trained (``counts``, e.g. summed over shards,
        else this stream's) and epochs: its records drawn (trained or rejected) over its records,
        None until it was read through once (its size is not known before); None without weights."""
        if self.counts is None:
            return None
        counts = counts or self.counts.state()
        sizes = self.source.first_pass
        epochs = [drawn / sizes[g][0] if g in sizes else None for g, drawn in enumerate(self.counts.drawn(counts))]
        return counts_report(self.counts.names, counts, epochs)

    def _pull(self) -> PackItem[MeasuredSample]:
        piece = next_pending_piece(self.pieces, self.dealt_pieces, self._measure_at, self.packer.seq_len)
        if piece is not None:
            return piece
        while True:
            dealt = self.dealt.pop()
            position = dealt or (self.epoch, self.cursor)
            sample = self.source.get(*position)
            if sample is None:  # past the end: next epoch (a dealt position is never past it)
                self._end_epoch()
                continue
            if dealt is None:
                self._check_first_passes(position)
                self.cursor += self.shard_count
            measured = sample if isinstance(sample, Reject) else self.measurer.measure(sample)
            # With @weights: the entry the record came from, and whether it is of the entry's first pass.
            group, passes = self.source.origin(*position) if self.counts is not None else (None, None)
            if isinstance(measured, MeasuredSample):
                self._accepted_this_epoch = True
                if position[0] == 0 and passes == 0:
                    self._accepted_first_pass.add(group)
                first, *self.pieces = pack_items(position, measured, self.packer.seq_len)
                return first
            self.rejects.record(measured)
            self._rejected_this_epoch[measured.reason] += 1
            if self.counts is not None:
                self.counts.reject(group)

    def _check_first_passes(self, position: tuple[int, int]) -> None:
        """With @weights, stop as soon as an entry's first pass is known to hold no usable record (its
        weight would silently go to the others): once this stream reads past the window that holds
        the entry's last first-pass record (window shuffling moves records within a window only)."""
        epoch, at = position
        if self.counts is None or epoch > 0 or len(self._usable) == len(self.counts.names):
            return
        for group, (_, last) in sorted(self.source.first_pass.items()):
            if group not in self._usable and last < at - at % self.source.window:
                self._check_usable(group, last)

    def _check_usable(self, group: int, last: int) -> None:
        """Entry ``group`` holds a usable record: this stream accepted one of its first pass, or one of
        its first pass (other shards' positions too) measures; else the one-line InputError."""
        if group in self._accepted_first_pass:
            self._usable.add(group)
            return
        reasons: Counter = Counter()
        for position in range((last // self.source.window + 1) * self.source.window):
            if self.source.origin(0, position) != (group, 0):
                continue
            measured = self._measure_at((0, position))
            if isinstance(measured, MeasuredSample):
                self._usable.add(group)
                return
            reasons[measured.reason] += 1
        raise all_rejected_error(self.counts.names[group], reasons, "records")

    def _end_epoch(self) -> None:
        if self.epoch == 0 and self.counts is not None:  # every entry's first pass has been read
            for group, (_, last) in sorted(self.source.first_pass.items()):
                if group not in self._usable:
                    self._check_usable(group, last)
        if not self._accepted_this_epoch:
            by_reason = ", ".join(f"{r}: {n}" for r, n in sorted(self._rejected_this_epoch.items())) or "none read"
            share = f" of data-parallel shard {self.shard_index} of {self.shard_count}" if self.shard_count > 1 else ""
            where = f"; see {self.rejects.path}" if self.rejects.path is not None else ""
            raise InputError(f"a whole pass over data.paths{share} gave no usable sample ({by_reason}){where}")
        self.epoch, self.cursor = self.epoch + 1, self.shard_index
        self._accepted_this_epoch = False
        self._rejected_this_epoch.clear()

    def _measure_at(self, position: tuple[int, int]) -> Union[MeasuredSample, Reject, None]:
        sample = self.source.get(*position)
        if sample is None or isinstance(sample, Reject):
            return sample
        return self.measurer.measure(sample)

    def state_dict(self) -> dict:
        keys = self.packer.buffer_keys()
        pieces = [item.key for item in self.pieces]
        seek_to = [self.cursor] + [k[1] for k in keys + pieces] + [p for _, p in self.dealt.first()]
        seek_to += [position for _, position, _ in self.dealt_pieces]
        return {"epoch": self.epoch, "cursor": self.cursor, "buffer": [list(k) for k in keys],
                "pieces": [list(k) for k in pieces], "dealt_pieces": [list(d) for d in self.dealt_pieces],
                "shard": [self.shard_index, self.shard_count], "dealt": self.dealt.state(),
                "window_starts": self.source.state_for(seek_to), **self._mixture_state()}

    def _mixture_state(self) -> dict:
        """With @weights: the weights, the counts, the entries read through (their sizes) and those
        known to hold a usable record."""
        if self.counts is None:
            return {}
        return {"mixture": self.source.weights, "sources": self.counts.state(),
                "first_pass": self.source.first_pass_json(), "usable": sorted(self._usable)}

    def load_state_dict(self, state: dict) -> None:
        if "window_starts" not in state:
            raise ValueError("the checkpoint's data position was not saved by a streaming run; "
                             "resume with data.streaming=false")
        check_same_weights(state.get("mixture"), self.source.weights)
        self.source.load_starts(state["window_starts"])
        if self.counts is not None:
            self.counts.load(state["sources"])
            self.source.load_first_pass(state.get("first_pass", {}))
            # Saved before this was checked: an entry past its first pass trained (issue 49).
            self._usable = set(state.get("usable", range(len(self.counts.names))))
            self._accepted_first_pass = set()
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.dealt = DealtPositions(state.get("dealt"))
        self._accepted_this_epoch = True  # the checkpointed run had accepted samples
        self.packer.buffer = measured_buffer(state["buffer"], self._measure_at, self.packer.seq_len)
        self.pieces = measured_buffer(state.get("pieces", []), self._measure_at, self.packer.seq_len)
        self.dealt_pieces = deque(state.get("dealt_pieces", []))


    def redealt(self, states: list[dict]) -> dict:
        """This shard's state continuing the saved ``states`` of all shards of a run at another DP
        size (``loongforge.data.redeal``). Counting an epoch's records reads the data through once."""
        for state in states:  # every shard's window starts: the dealt positions lie in any of them
            self.source.load_starts(state["window_starts"])
        dealt = redeal(states, self.shard_count, self.source.record_count())[self.shard_index]
        starts = {k: v for state in states for k, v in state["window_starts"].items()}
        if self.counts is None:
            return {**dealt, "window_starts": starts}
        first_pass = {k: v for state in states for k, v in state.get("first_pass", {}).items()}
        usable = sorted({g for state in states for g in state.get("usable", range(len(self.counts.names)))})
        return {**dealt, "window_starts": starts, "mixture": self.source.weights,
                "sources": redealt_counts([s["sources"] for s in states], self.shard_index),
                "first_pass": first_pass, "usable": usable}


def pack_items(position: tuple[int, int], measured: MeasuredSample, seq_len: int) -> list[PackItem[MeasuredSample]]:
    """The packer items of the sample at stream ``position``: one keyed ``(epoch, position)``, or for
    a document longer than ``seq_len`` one per piece (``measure.document_pieces``), keyed
    ``(epoch, position, piece)``."""
    pieces = document_pieces(measured, seq_len)
    if len(pieces) == 1:
        return [PackItem(key=tuple(position), length=measured.length, payload=measured)]
    return [PackItem(key=(*position, piece.piece), length=piece.length, payload=piece) for piece in pieces]


def dealt_document_items(dealt_pieces: deque, measure_at, seq_len: int) -> list[PackItem[MeasuredSample]]:
    """The untrained pieces of the next part-trained document a re-deal handed this shard
    (``redeal.untrained_pieces``), taken off ``dealt_pieces``; [] when none is left."""
    if not dealt_pieces:
        return []
    epoch, position, wanted = dealt_pieces.popleft()
    measured = measure_at((epoch, position))
    if not isinstance(measured, MeasuredSample):
        raise RuntimeError(f"document at epoch {epoch} position {position} no longer measures "
                           f"(data changed since the checkpoint?): {measured}")
    return [item for item in pack_items((epoch, position), measured, seq_len)
            if len(item.key) == 3 and item.key[2] in wanted]


def next_pending_piece(pieces: list[PackItem[MeasuredSample]], dealt_pieces: deque, measure_at,
                       seq_len: int) -> Optional[PackItem[MeasuredSample]]:
    """A stream's next piece of a long document: off ``pieces`` (the document it is part way through),
    refilled in place from ``dealt_pieces`` (``dealt_document_items``) when empty; None when neither
    holds one."""
    if not pieces:
        pieces.extend(dealt_document_items(dealt_pieces, measure_at, seq_len))
    return pieces.pop(0) if pieces else None


def measured_buffer(keys: list, measure_at, seq_len: int) -> list[PackItem[MeasuredSample]]:
    """The packer buffer (or pieces to come) a checkpoint names by stream positions, ``[epoch,
    position]`` or ``[epoch, position, piece]``, measured again (a stream's ``load_state_dict``); a
    position that no longer measures means the data changed."""
    buffer = []
    for key in keys:
        epoch, position = key[0], key[1]
        measured = measure_at((epoch, position))
        if not isinstance(measured, MeasuredSample):
            raise RuntimeError(f"buffered sample at epoch {epoch} position {position} no longer measures "
                               f"(data changed since the checkpoint?): {measured}")
        items = pack_items((epoch, position), measured, seq_len)
        buffer.append(items[key[2]] if len(key) == 3 else items[0])
    return buffer
