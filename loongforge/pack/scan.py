"""Scan stage: every input sample -> one scan record (measured lengths, or a reject); a document
longer than the pack's capacity -> one record per piece (``measure.document_pieces``, ``"piece"``).

A record is ``{"i", "id", "file", "line", "record", "tokens", "patches", "images", "videos", "loss_tokens"}``
for a usable sample (``tokens``: LLM tokens with media pads expanded, exact; ``patches``: vision
patches t*h*w before the 2x2 merge, per image then per video) or ``{"i", "file", "line", "record",
"reason", "detail"}`` for a rejected one (``record``: the sample's ordinal in its file, what names
it; ``line``: where it starts). Records are written in chunks of
``folder.SCAN_CHUNK`` samples, each file complete or absent, so a resumed scan redoes at most the
chunks in flight.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

from loongforge.data.measure import MeasuredSample, document_pieces
from loongforge.data.packfile import folder
from loongforge.data.packfile.folder import read_lines, scan_part, write_lines_atomic
from loongforge.pack import workers


def scan_records(index: int) -> list[dict]:
    """Sample ``index``'s scan record, or one per piece of a document cut to the pack's capacity."""
    measured = workers.measure_index(index)
    if not isinstance(measured, MeasuredSample):
        return [scan_record(index, measured)]
    return [scan_record(index, piece) for piece in document_pieces(measured, workers.seq_len())]


def scan_record(index: int, measured) -> dict:
    where = {"file": measured.file, "line": measured.line}
    if measured.record is not None:
        where["record"] = measured.record
    if not isinstance(measured, MeasuredSample):
        return {"i": index, **where, "reason": measured.reason, "detail": measured.detail}
    if measured.piece is not None:
        where["piece"] = measured.piece
    patches = [t * h * w for t, h, w in measured.image_grids]
    patches += [t * h * w for t, h, w in (plan.grid_thw for plan in measured.video_plans)]
    return {"i": index, "id": measured.sample_id, **where,
            "tokens": measured.length, "patches": patches, "images": len(measured.image_grids),
            "videos": len(measured.video_plans), "loss_tokens": measured.loss_tokens}


def _scan_chunk(task: tuple[int, int, int]) -> tuple[int, list[dict]]:
    chunk, start, stop = task
    return chunk, [record for i in range(start, stop) for record in scan_records(i)]


def num_chunks(num_samples: int) -> int:
    return math.ceil(num_samples / folder.SCAN_CHUNK)


def run_scan(root: Path, num_samples: int, context: workers.MeasureContext, *, num_workers: int,
             on_chunk: Optional[Callable[[int, int], None]] = None) -> int:
    """Scan the chunks not yet on disk; ``on_chunk(chunk, samples)`` after each is written.
    Returns the number of samples scanned in this call."""
    size = folder.SCAN_CHUNK
    tasks = [(c, c * size, min(num_samples, (c + 1) * size))
             for c in range(num_chunks(num_samples)) if not scan_part(root, c).exists()]
    scanned = 0
    for chunk, records in workers.map_ordered(_scan_chunk, tasks, context, num_workers):
        write_lines_atomic(scan_part(root, chunk), records)
        scanned += len(records)
        if on_chunk is not None:
            on_chunk(chunk, len(records))
    return scanned


def read_scan(root: Path, num_samples: int) -> list[dict]:
    """All scan records in input order; checks that the chunks cover every sample once."""
    records: list[dict] = []
    for chunk in range(num_chunks(num_samples)):
        records.extend(read_lines(scan_part(root, chunk)))
    if [r["i"] for r in records if r.get("piece", 0) == 0] != list(range(num_samples)):
        raise RuntimeError(f"scan chunks under {root} do not cover samples 0..{num_samples - 1} exactly once")
    return records
