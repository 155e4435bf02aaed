"""Write stage: each shard's packs -> one parquet file (rows in ``shard_format.SCHEMA``).

Samples are measured again from the inputs (tokenization is cheaper than storing every token
of the scan) and must give the scanned length, else the inputs changed since the scan. A shard
is written whole or not at all, so a resumed run rewrites only shards that are missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from loongforge.config.errors import InputError
from loongforge.data.measure import MeasuredSample, document_pieces
from loongforge.data.packfile.folder import shard_name, write_atomic
from loongforge.data.packfile.schema import SCHEMA, encode_pack
from loongforge.pack import workers
from loongforge.pack.manifest import Plan

# (shard, folder, [(pack number, [(sample index, piece or None, scanned tokens), ...]), ...])
ShardTask = tuple[int, str, list[tuple[int, list[tuple[int, Optional[int], int]]]]]


def shard_tasks(root: Path, plan: Plan) -> list[ShardTask]:
    tasks = []
    for shard in range(plan.num_shards):
        if (root / shard_name(shard)).exists():
            continue
        packs = [(number, [(plan.accepted[k]["i"], plan.accepted[k].get("piece"), plan.accepted[k]["tokens"])
                           for k in plan.packs[number].tolist()])
                 for number in plan.shard_packs(shard)]
        tasks.append((shard, str(root), packs))
    return tasks


def write_shard(task: ShardTask) -> tuple[int, int]:
    """Build and write one shard; returns (shard, samples written)."""
    shard, root, packs = task
    rows = []
    for number, members in packs:
        samples = []
        for index, piece, tokens in members:
            measured = workers.measure_index(index)
            if isinstance(measured, MeasuredSample) and piece is not None:
                measured = document_pieces(measured, workers.seq_len())[piece]
            if not isinstance(measured, MeasuredSample) or measured.length != tokens:
                found = measured.length if isinstance(measured, MeasuredSample) else measured.reason
                raise InputError(f"sample {index} measured {tokens} tokens at scan time but {found} now: "
                                 f"the inputs changed since the scan; pack into a new folder")
            samples.append(measured)
        rows.append(encode_pack(number, samples))
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=1, compression="zstd")
    write_atomic(Path(root) / shard_name(shard), sink.getvalue().to_pybytes())
    return shard, sum(len(members) for _, members in packs)


def run_write(root: Path, plan: Plan, context: workers.MeasureContext, *, num_workers: int,
              on_shard: Optional[Callable[[int, int], None]] = None) -> int:
    """Write the missing shards; ``on_shard(shard, samples)`` after each. Returns samples written."""
    written = 0
    for shard, count in workers.map_ordered(write_shard, shard_tasks(root, plan), context, num_workers):
        written += count
        if on_shard is not None:
            on_shard(shard, count)
    return written
