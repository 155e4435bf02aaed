"""Conversation records through memory-mapped Arrow (Hugging Face ``datasets``): what ``train``,
``pack`` and ``encode`` read.

Each JSON / JSONL / parquet / .txt file is copied once into an Arrow file in the cache folder
(``data.cache_dir``, default ``<LOONGFORGE_CACHE>/datasets``), named by a hash of the file's
content, and memory-mapped from there by every process: a rank holds a few offsets, not the
records, and the page cache holds one copy per node. The first process of a node to need a copy
builds it under a file lock; the others wait and map it. A ``save_to_disk`` folder or a dataset in
the local Hugging Face cache (``hf:NAME``, ``hf:NAME:SPLIT``) is already Arrow and is mapped as is.

Samples, their order and their rejects are those of the in-memory reader
(``loongforge.data.conversations.FileSamples``): JSON lines are stored undecoded and decoded on
access; JSON arrays are stored element by element with their lines; each record with its ordinal
(``conversations._Located``, what names its sample); table rows (parquet, saved and cached
datasets) come back as plain values (images as ``{"bytes", "path"}``), line = row + 1, ordinal = row.
"""

from __future__ import annotations

import bisect
import errno
import json
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash
from filelock import FileLock
from tqdm import tqdm

from loongforge.config.errors import InputError
from loongforge.data.cache import cache_root, cache_write_problem, write_cache_file
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
from loongforge.data.fingerprint import Fingerprint, content_fingerprint, head_tail_hash, source_fingerprint
from loongforge.data.mapped_pages import MappedPages
from loongforge.data.record_kinds import RecordReading
from loongforge.data.samples import Reject, Sample

if TYPE_CHECKING:
    import datasets

# Bump when what a cache file holds changes, so stale copies are never mapped.
# 2: a COCO captions .json holds one caption record per annotation (1 read it as one JSON line).
# 3: every record holds its ordinal (2 only those sharing a line with others).
CACHE_FORMAT = 3
_RECORDS_SCHEMA = pa.schema([
    ("line", pa.int64()),  # 1-based line the record starts at
    ("ordinal", pa.int64()),  # its position in its file (conversations._Located.ordinal)
    ("raw", pa.large_binary()),  # the record's JSON text; null when it could not be read
    ("error", pa.string()),  # why it could not be read; null otherwise
])
_BATCH_ROWS = 65_536
_HASH_CHUNK = 16 << 20
_PROGRESS_BYTES = 64 << 20  # a copy of a smaller file takes about a second: no bar


def arrow_cache_dir(cache_dir: Optional[str]) -> Path:
    """``data.cache_dir``, or the loongforge cache's ``datasets`` folder."""
    return Path(cache_dir) if cache_dir else cache_root() / "datasets"


# ---------------------------------------------------------------- content keys


def content_key(path: Path, cache: Path) -> str:
    """Hash of the file's bytes, remembered per (path, size, mtime, ctime, inode) and checked against
    a hash of the file's first and last 64 KiB, so that a warm start does not read every data file
    again, and a rewrite in place that keeps the size and restores the mtime is still noticed."""
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}"
    ends = head_tail_hash(path, stat.st_size)
    memo = cache / "keys" / f"{xxhash.xxh3_64_hexdigest(identity.encode())}.json"
    if memo.is_file():
        remembered = json.loads(memo.read_text(encoding="utf-8"))
        if remembered.get("identity") == identity and remembered.get("head_tail") == ends:
            return remembered["key"]
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    key = digest.hexdigest()
    try:
        write_cache_file(memo, json.dumps({"identity": identity, "head_tail": ends, "key": key}))
    except OSError as error:  # a read-only cache of prebuilt copies is usable: the memo only saves time
        if cache_write_problem(error, cache, "remembering a content key") is None:
            raise
    return key


# ---------------------------------------------------------------- building a copy


def _jsonl_batches(path: Path, bar: tqdm) -> Iterator[pa.RecordBatch]:
    """JSON lines, undecoded (decoded on access, so a broken line costs nothing here)."""
    lines, raws = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            bar.update(len(raw))
            if not raw.strip():
                continue
            lines.append(number)
            raws.append(raw)
            if len(raws) == _BATCH_ROWS:
                yield _records_batch(lines, _line_ordinals(lines), raws, None)
                lines, raws = [], []
    if raws:
        yield _records_batch(lines, _line_ordinals(lines), raws, None)


def _line_ordinals(lines: list[int]) -> list[int]:
    """The ordinals of records one per line (``conversations._Located.ordinal``): line - 1."""
    return [line - 1 for line in lines]


def _txt_batches(path: Path, bar: tqdm) -> Iterator[pa.RecordBatch]:
    """A .txt file's documents (one per non-empty line) as ``{"text": ...}`` JSON records, read a
    line at a time (a pretraining corpus need not fit in memory)."""
    lines, raws, errors = [], [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            bar.update(len(raw))
            for entry in text_line_record(number, raw):
                lines.append(entry.line)
                raws.append(None if entry.error else json.dumps(entry.record, ensure_ascii=False).encode())
                errors.append(entry.error)
            if len(raws) == _BATCH_ROWS:
                yield _records_batch(lines, _line_ordinals(lines), raws, errors)
                lines, raws, errors = [], [], []
    if raws:
        yield _records_batch(lines, _line_ordinals(lines), raws, errors)


def _json_batches(path: Path, bar: tqdm) -> Iterator[pa.RecordBatch]:
    """A .json file through the in-memory reader (a JSON list must be parsed as a whole)."""
    located = read_data_file(path)
    bar.update(path.stat().st_size)
    for start in range(0, len(located), _BATCH_ROWS):
        chunk = located[start:start + _BATCH_ROWS]
        raws = [None if e.error is not None else json.dumps(e.record, ensure_ascii=False).encode() for e in chunk]
        yield _records_batch([e.line for e in chunk], [e.ordinal for e in chunk], raws, [e.error for e in chunk])


def _records_batch(lines, ordinals, raws, errors) -> pa.RecordBatch:
    count = len(lines)
    return pa.record_batch([
        pa.array(lines, pa.int64()),
        pa.array(ordinals, pa.int64()),
        pa.array(raws, pa.large_binary()),
        pa.array(errors, pa.string()) if errors is not None else pa.nulls(count, pa.string()),
    ], schema=_RECORDS_SCHEMA)


def _parquet_batches(path: Path, bar: tqdm) -> Iterator[pa.RecordBatch]:
    parquet = pq.ParquetFile(path)
    for group in range(parquet.num_row_groups):
        for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=[group]):
            yield batch.replace_schema_metadata(None)  # plain values, never decoded features
        bar.update(parquet.metadata.row_group(group).total_byte_size)


def _temp_name(target: Path) -> str:
    """A prefix naming who writes: two nodes of a shared cache may run processes with the same pid
    (containers), so the host is part of it, and mkstemp makes the name unique whatever it is."""
    return f"{target.name}.{socket.gethostname()}.{os.getpid()}."


def _rows_in(copy: Path) -> Optional[int]:
    """Rows of an Arrow stream file, read back (batch headers only: the file is memory-mapped);
    None when it does not read as one."""
    try:
        with pa.memory_map(str(copy)) as source:
            return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
    except (pa.ArrowException, OSError):  # pyarrow reports a short file as an OSError
        return None


def _write_copy(path: Path, target: Path, progress: bool) -> None:
    """Write the Arrow copy of ``path`` to ``target``: into a temp file of this process's own, read
    back and checked to hold every row written, flushed to disk, then renamed into place, so that a
    killed build, a full disk or another writer never leaves a partial copy under a content key."""
    if path.suffix == ".parquet":
        batches, schema = _parquet_batches, pq.read_schema(path).remove_metadata()
    else:
        batches = {".jsonl": _jsonl_batches, ".txt": _txt_batches}.get(path.suffix, _json_batches)
        schema = _RECORDS_SCHEMA
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=_temp_name(target), suffix=".tmp")
    os.close(fd)
    try:
        written = 0
        with tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"arrow copy of {path.name}",
                  disable=not progress or path.stat().st_size < _PROGRESS_BYTES, leave=False) as bar:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
                for batch in batches(path, bar):
                    writer.write_batch(batch)
                    written += batch.num_rows
        expected = pq.ParquetFile(path).metadata.num_rows if path.suffix == ".parquet" else written
        if (found := _rows_in(Path(tmp))) != expected:
            held = "an unreadable file" if found is None else f"{found} rows"
            raise RuntimeError(f"the Arrow copy of {path} came out holding {held}, not {expected} rows (another "
                               f"process writing {tmp}? a failing disk?); it was not published; run again")
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # a crash must not leave a published name whose bytes never reached the disk
        finally:
            os.close(fd)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is shared by users of the machine
        _publish(Path(tmp), target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _publish(tmp: Path, target: Path) -> None:
    """Give the finished ``tmp`` its content-key name unless a builder on another node did first:
    a hard link is atomic and never replaces, so a copy that ranks have mapped stays in place (on a
    network file system, replacing a file another node has open fails that node's reads)."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        pass  # the same bytes, published by another builder
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        if not target.exists():  # a file system without hard links
            os.replace(tmp, target)


def _estimated_copy_bytes(path: Path) -> int:
    """About what the Arrow copy of ``path`` takes: its records' bytes (parquet: uncompressed)."""
    if path.suffix == ".parquet":
        metadata = pq.ParquetFile(path).metadata
        return sum(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
    return path.stat().st_size


def _check_room(path: Path, folder: Path) -> None:
    needed, free = _estimated_copy_bytes(path), shutil.disk_usage(folder).free
    if needed > free:
        raise InputError(f"data.cache_dir {folder.parent} is full: the Arrow copy of {path} needs about "
                         f"{_size_text(needed)}, {_size_text(free)} is free; free space there or point "
                         "data.cache_dir (or LOONGFORGE_CACHE) at a larger node-local disk")


def arrow_copy(path: Path, cache: Path, *, progress: bool = True, key: Optional[str] = None) -> Path:
    """The cache's Arrow copy of data file ``path``, built here unless a process built it already.
    ``key``: its ``content_key`` when the caller has it."""
    kind = "table" if path.suffix == ".parquet" else "records"
    target = cache / f"v{CACHE_FORMAT}" / f"{key or content_key(path, cache)}-{kind}.arrow"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if not target.is_file():  # the lock's previous holder may have built it
                _check_room(path, target.parent)
                _write_copy(path, target, progress)
    except OSError as error:
        problem = cache_write_problem(error, cache, f"making the Arrow copy of {path}")
        if problem is None:
            raise
        raise InputError(problem) from None
    return target


def _size_text(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def cache_summary(cache_dir: Optional[str]) -> str:
    """The start-up line on the Arrow cache: where it is, what it holds, how much room is left."""
    cache = arrow_cache_dir(cache_dir)
    copies = list((cache / f"v{CACHE_FORMAT}").glob("*.arrow"))
    held = sum(copy.stat().st_size for copy in copies)
    existing = next(p for p in (cache, *cache.parents) if p.exists())
    return (f"cache: {cache}, {len(copies)} Arrow cop{'y' if len(copies) == 1 else 'ies'} "
            f"({_size_text(held)}), {_size_text(shutil.disk_usage(existing).free)} free")


# ---------------------------------------------------------------- sources


@dataclass
class _Part:
    """One source: its rows (memory-mapped), the name rejects carry, and where relative media are."""

    rows: datasets.Dataset
    file: str
    media_root: Path
    records: bool  # rows are (line, ordinal, raw, error) records, else plain table rows
    fingerprint: Fingerprint  # what a checkpoint records of the source (loongforge.data.fingerprint)
    reading: RecordReading = DEFAULT_READING  # how its records become samples (record_kinds)

    def __post_init__(self):
        self.pages = MappedPages([entry["filename"] for entry in self.rows.cache_files])

    def __len__(self) -> int:
        return self.rows.num_rows

    def get(self, row: int) -> Union[Sample, Reject]:
        self.pages.read()
        if self.records:
            return self._record(self.rows[row])
        record = self.rows[row].to_pylist()[0]  # arrow format: storage values, images undecoded
        return parse_record(record, file=self.file, line=row + 1, ordinal=row, media_root=self.media_root,
                            reading=self.reading)

    def _record(self, entry: dict) -> Union[Sample, Reject]:
        where = {"file": self.file, "line": entry["line"], "media_root": self.media_root, "ordinal": entry["ordinal"],
                 "reading": self.reading}
        if entry["error"] is not None:
            return read_record(None, entry["error"], **where)
        return read_json_record(entry["raw"], **where)


def _file_part(path: Path, cache: Path, progress: bool, reading: RecordReading) -> _Part:
    import datasets  # lazy: ~0.7 s to import, paid only where data.source=files opens a file

    key = content_key(path, cache)
    copy = arrow_copy(path, cache, progress=progress, key=key)
    rows = datasets.Dataset.from_file(str(copy))
    records = path.suffix != ".parquet"
    return _Part(rows if records else rows.with_format("arrow"), str(path), path.parent, records,
                 content_fingerprint(str(path), path.stat().st_size, key), reading_of(path, reading))


def load_saved_dataset(folder: Path) -> datasets.Dataset:
    """A folder written by ``Dataset.save_to_disk`` (``is_saved_dataset``), memory-mapped."""
    import datasets  # lazy: ~0.7 s to import, paid only where data.source=files opens a dataset

    return datasets.load_from_disk(str(folder))


def _saved_part(folder: Path, reading: RecordReading) -> _Part:
    return _Part(load_saved_dataset(folder).with_format("arrow"), str(folder), folder, records=False,
                 fingerprint=source_fingerprint(str(folder)), reading=reading)


def open_hub_dataset(entry: str) -> datasets.Dataset:
    """``hf:NAME`` or ``hf:NAME:SPLIT`` (default split ``train``), from the local HF cache."""
    import datasets  # lazy: ~0.7 s to import, paid only where data.source=files opens a dataset

    name, _, split = entry[len(HUB_PREFIX):].partition(":")
    try:
        return datasets.load_dataset(name, split=split or "train")
    except Exception as error:  # datasets raises many types for "not found / not cached"
        raise InputError(f"data.paths entry {entry!r} cannot be loaded ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}); download it once with "
                         f"datasets.load_dataset({name!r}) on a connected machine") from None


def _hub_part(entry: str, reading: RecordReading) -> _Part:
    return _Part(open_hub_dataset(entry).with_format("arrow"), entry, Path.cwd(), records=False,
                 fingerprint=source_fingerprint(entry), reading=reading)


def _open_source(source: str, cache: Path, progress: bool, reading: RecordReading) -> _Part:
    if source.startswith(HUB_PREFIX):
        return _hub_part(source, reading)
    path = Path(source)
    if path.is_dir() and is_saved_dataset(path):
        return _saved_part(path, reading)
    return _file_part(path, cache, progress, reading)


class ArrowSamples:
    """All records of ``data.paths`` in a fixed order (sources in order, records in source order),
    indexable without holding them: ``get`` reads, validates and returns a sample or a Reject.
    ``reading``: how records become samples (``data.record_kind``, ``data.caption_prompt``)."""

    def __init__(self, paths: list[str], cache_dir: Optional[str] = None, *, progress: bool = True,
                 reading: RecordReading = DEFAULT_READING):
        cache = arrow_cache_dir(cache_dir)
        self._parts = [_open_source(source, cache, progress, reading) for source in expand_data_paths(paths)]
        self._starts = np.cumsum([0] + [len(part) for part in self._parts]).tolist()  # per part, its first index
        self._entries = entry_groups(paths)  # per data.paths entry, its parts

    def entry_spans(self) -> list[range]:
        """Per data.paths entry, the indices of its samples (a weighted mixture draws from them)."""
        return [range(self._starts[group.start], self._starts[group.stop]) for group in self._entries]

    def __len__(self) -> int:
        return self._starts[-1]

    def fingerprints(self) -> list[Fingerprint]:
        """One per source, in order: what a checkpoint records to notice a changed file on resume."""
        return [part.fingerprint for part in self._parts]

    def get(self, index: int) -> Union[Sample, Reject]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        part = bisect.bisect_right(self._starts, index) - 1
        return self._parts[part].get(index - self._starts[part])
