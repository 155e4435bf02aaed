"""Names inside a pack folder and the atomic, deterministic way files are written there."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

# 2: samples named by their record, not their line (1; a folder of 1 is refused: pack again).
FORMAT = "loongforge-pack/2"
CONFIG_FILE = "pack_config.json"  # what produced the folder; --resume refuses a different one
SCAN_DIR = "scan"
MANIFEST_FILE = "manifest.jsonl"
REJECTS_FILE = "rejects.jsonl"
SHARD_DIR = "shards"
STATS_FILE = "stats.json"  # written last: its presence marks a complete folder
TMP_SUFFIX = ".tmp"

# Samples per scan chunk: the unit of resumable scan work (fixed, so the output never depends on it).
SCAN_CHUNK = 1000


def scan_part(root: Path, chunk: int) -> Path:
    return root / SCAN_DIR / f"part-{chunk:06d}.jsonl"


def shard_name(shard: int) -> str:
    """Shard path relative to the folder, as the manifest records it."""
    return f"{SHARD_DIR}/shard-{shard:05d}.parquet"


def json_line(record: Any) -> str:
    return json.dumps(record, ensure_ascii=False, sort_keys=False, separators=(", ", ": ")) + "\n"


def write_atomic(path: Path, data: bytes) -> None:
    """Write to ``path.tmp`` then rename: a killed run leaves either nothing or the whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_lines_atomic(path: Path, records: Iterable[Any]) -> None:
    write_atomic(path, "".join(json_line(r) for r in records).encode("utf-8"))


def read_lines(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def remove_partial_files(root: Path) -> int:
    """Delete ``*.tmp`` left by a killed run; returns how many."""
    stale = sorted(root.rglob(f"*{TMP_SUFFIX}"))
    for path in stale:
        path.unlink()
    return len(stale)
