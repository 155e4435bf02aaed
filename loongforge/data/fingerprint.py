"""Fingerprints of the data files a run reads, kept in its checkpoints, so that a resume notices a
changed file instead of seeking the old byte offsets (streaming) or indices (Arrow) into new content.

A checkpoint's data state holds one fingerprint per source of ``data.paths`` (``files``): its size
and either the content key of its Arrow copy (a hash of every byte, ``arrow_samples.content_key``,
already computed to find the copy) or, where nothing reads the file whole (``data.streaming``),
``head_tail``: a hash of its first and last 64 KiB. A ``save_to_disk`` folder is fingerprinted by its
files' names and sizes and the bytes of its ``state.json`` (which holds ``datasets``' own fingerprint);
``hf:`` entries by nothing (the Hugging Face cache keeps one revision per folder).

On resume ``check_files`` compares source by source (a file that moved with the same bytes is the
same file) and refuses in one line naming the first changed source. ``data.accept_changed_files``
continues instead from the recorded sample count: the same epoch and the same number of samples
into it, counted in the changed data (``counted_position``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import xxhash

from loongforge.config.errors import InputError
from loongforge.data.conversations import HUB_PREFIX, expand_data_paths

# Hashed at each end: a rewrite that keeps the size rarely keeps both ends, and a start that
# fingerprints thousands of shards reads 128 KiB of each, not the data.
HEAD_TAIL_BYTES = 64 << 10
Fingerprint = dict  # {"file": str, "size": int, and "content" or "head_tail": str}; {"file"} for hf: entries


def head_tail_hash(path: Path, size: int, span: int = HEAD_TAIL_BYTES) -> str:
    """xxh3-128 of the size, the first ``span`` bytes and the last ``span`` bytes of ``path``."""
    digest = xxhash.xxh3_128(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(span))
        if size > span:
            f.seek(max(span, size - span))
            digest.update(f.read(span))
    return digest.hexdigest()


def source_fingerprint(source: str) -> Fingerprint:
    """The fingerprint of one source of ``data.paths`` without reading it whole."""
    path = Path(source)
    if source.startswith(HUB_PREFIX):
        return {"file": source}
    if path.is_dir():
        return {"file": source, **_folder_fingerprint(path)}
    size = path.stat().st_size
    return {"file": source, "size": size, "head_tail": head_tail_hash(path, size)}


def _folder_fingerprint(folder: Path) -> dict:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    digest = xxhash.xxh3_128()
    for path in files:
        digest.update(f"{path.relative_to(folder)}|{path.stat().st_size}\n".encode())
        if path.name == "state.json":
            digest.update(path.read_bytes())
    return {"size": sum(p.stat().st_size for p in files), "head_tail": digest.hexdigest()}


def content_fingerprint(source: str, size: int, key: str) -> Fingerprint:
    """A file read whole into its Arrow copy: ``key`` hashes every byte."""
    return {"file": source, "size": size, "content": key}


def run_fingerprints(source_kind: str, paths: list, samples=None) -> Optional[list[Fingerprint]]:
    """The fingerprints a checkpoint of this run records: ``samples.fingerprints()`` where the
    sample source has them (``ArrowSamples``), else each source's ends; None unless
    ``data.source=files``."""
    if source_kind != "files":
        return None
    fingerprints = getattr(samples, "fingerprints", None)
    if fingerprints is not None:
        return fingerprints()
    return [source_fingerprint(source) for source in expand_data_paths(paths)]


def _difference(recorded: Fingerprint, current: Fingerprint) -> Optional[str]:
    """How ``current`` differs from ``recorded``, or None. Only what both hold is compared: an Arrow
    run's fingerprints hash the whole file, a streaming run's its ends."""
    if recorded.get("size") != current.get("size"):
        return f"size {recorded.get('size')} -> {current.get('size')} bytes"
    for kind in ("content", "head_tail"):
        if kind in recorded and kind in current and recorded[kind] != current[kind]:
            return "same size, different content"
    return None


def first_change(recorded: list[Fingerprint], current: list[Fingerprint]) -> Optional[str]:
    """The first source that differs, in words (naming it), or None when none does."""
    for index, (before, now) in enumerate(zip(recorded, current)):
        difference = _difference(before, now)
        if difference is not None:
            moved = f" (recorded as {before['file']})" if before["file"] != now["file"] else ""
            return f"data file {now['file']}{moved} changed since the checkpoint ({difference})"
    if len(current) > len(recorded):
        return (f"data.paths source {current[len(recorded)]['file']} is new since the checkpoint "
                f"({len(recorded)} sources then, {len(current)} now)")
    if len(recorded) > len(current):
        return (f"data.paths source {recorded[len(current)]['file']} is gone since the checkpoint "
                f"({len(recorded)} sources then, {len(current)} now)")
    return None


def check_files(recorded: Optional[list[Fingerprint]], current: Optional[list[Fingerprint]], *,
                accept_changed: bool) -> Optional[str]:
    """Refuse (InputError, one line) a resume whose data files changed since the checkpoint; with
    ``accept_changed`` return the change instead (None: nothing changed, or nothing was recorded,
    as in checkpoints older than fingerprints)."""
    if recorded is None or current is None:
        return None
    change = first_change(recorded, current)
    if change is None or accept_changed:
        return change
    raise InputError(f"{change}: the checkpoint's data position (byte offsets, sample indices) no longer "
                     "names the same samples; restore the file, or set data.accept_changed_files=true to "
                     "continue from the recorded sample count in the changed data")


def counted_position(stream_state: dict, *, count: Optional[int], first: int) -> dict:
    """A stream state (``RowStream`` / ``StreamingRowStream``) that continues from its recorded
    sample count in changed data: same epoch and cursor, the byte offsets of window starts dropped
    (the stream reads forward to the cursor again), the packer's buffered positions and a cut
    document's pieces still to come dropped (they named samples of the old data). ``count``: samples
    per epoch, when known (indexed reading); a cursor past it starts the next epoch at ``first``,
    the stream's first position."""
    state = {**stream_state, "buffer": []}
    if state.get("pieces"):
        state["pieces"] = []
    if "window_starts" in state:
        state["window_starts"] = {}  # no window start known but the data's own: read forward from there
    if count is not None and int(state["cursor"]) >= count:
        state["epoch"], state["cursor"] = int(state["epoch"]) + 1, first
    return state
