"""Read a ``loongforge pack`` folder as the global stream of packed rows (``data.source=packed``).

Each pack is one row, as packed: the samples, their token ids, answer masks and media plans come
from the shard; only pixels are decoded at training time. The stream has the same interface as
``pipeline.RowStream`` (``next_row``, ``state_dict``, ``load_state_dict``), so ``DataPipeline``
splits rows over ranks, collates and resumes exactly as for ``data.source=files``. Epoch ``e``
visits every pack once, in a permutation drawn from (data.seed, e) when data.shuffle.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np

from loongforge.config.errors import InputError
from loongforge.data.measure import MeasuredSample
from loongforge.data.packfile.folder import FORMAT, MANIFEST_FILE, STATS_FILE
from loongforge.data.packfile.schema import decode_pack
from loongforge.data.packing import PackItem
from loongforge.data.vision import VisionSizing

_OPEN_SHARDS = 4  # parquet handles kept open; packs are read one row group at a time


class PackedFolder:
    """Random access to the packs of a finished pack folder."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        stats_path = self.root / STATS_FILE
        if not stats_path.exists():
            raise InputError(f"data.packed={self.root}: no {STATS_FILE}, so not a finished `loongforge pack` "
                             f"folder; run (or finish with --resume) `loongforge pack ... --output {self.root}`")
        self.stats = json.loads(stats_path.read_text())
        written = self.stats.get("format")
        if written != FORMAT:
            raise InputError(f"data.packed={self.root} was written by an older `loongforge pack` ({written}, not "
                             f"{FORMAT}: samples named by line, which records of a JSON array can share); "
                             f"pack the inputs again into a new folder")
        self.locations: list[tuple[str, int]] = []
        with open(self.root / MANIFEST_FILE, encoding="utf-8") as f:
            for line in f:
                entry = json.loads(line)
                self.locations.append((entry["shard"], entry["row"]))
        if len(self.locations) != self.stats["packs"]:
            raise InputError(f"data.packed={self.root}: manifest has {len(self.locations)} packs, stats.json "
                             f"{self.stats['packs']}; repack the folder")
        if not self.locations:
            raise InputError(f"data.packed={self.root} holds no packs (all samples rejected; see its rejects.jsonl)")
        self._files: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self.locations)

    def pack(self, index: int) -> list[MeasuredSample]:
        shard, row = self.locations[index]
        table = self._file(shard).read_row_group(row)
        (record,) = table.to_pylist()
        if record["pack"] != index:
            raise InputError(f"data.packed={self.root}: {shard} row {row} holds pack {record['pack']}, "
                             f"manifest says {index}; repack the folder")
        return decode_pack(record)

    def _file(self, shard: str):
        import pyarrow.parquet as pq  # lazy: pyarrow.parquet only once a shard is opened

        if shard not in self._files:
            if len(self._files) >= _OPEN_SHARDS:
                self._files.popitem(last=False)
            self._files[shard] = pq.ParquetFile(self.root / shard)
        self._files.move_to_end(shard)
        return self._files[shard]

    def check_compatible(self, seq_len: int, sizing: VisionSizing, sample_multiple: int = 1) -> None:
        """The packs must fit data.seq_len and were sized with the same image rules as training;
        under context parallelism (``sample_multiple`` > 1) they must have been packed counting each
        sample padded to a multiple of it (``loongforge pack --context-parallel``)."""
        if self.stats["seq_len"] > seq_len:
            raise InputError(f"data.packed={self.root} was packed for seq_len {self.stats['seq_len']} > "
                             f"data.seq_len={seq_len}; set data.seq_len={self.stats['seq_len']} or repack")
        packed_multiple = self.stats.get("sample_multiple", 1)
        if packed_multiple % sample_multiple:
            raise InputError(f"data.packed={self.root} was packed with samples padded to a multiple of "
                             f"{packed_multiple}, but parallel.context_parallel_size needs {sample_multiple}; "
                             f"repack with --context-parallel {sample_multiple // 2}")
        expected = {} if sizing is None else sizing.geometry()
        packed = self.stats["vision_sizing"]
        differing = sorted(k for k in expected.keys() | packed.keys() if packed.get(k) != expected.get(k))
        if differing:
            raise InputError(f"data.packed={self.root} sized images with other rules ({', '.join(differing)} "
                             f"differ from this config's model.vision/data settings); repack with this preset")


class PackedRowStream:
    """The global stream of packed rows read from a folder, identical on every rank."""

    def __init__(self, folder: PackedFolder, *, shuffle: bool, seed: int):
        self.folder = folder
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._orders: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            count = len(self.folder)
            order = np.random.default_rng([self.seed, epoch]).permutation(count) if self.shuffle else np.arange(count)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def next_row(self) -> list[PackItem[MeasuredSample]]:
        position = (self.epoch, self.cursor)
        pack = int(self.epoch_order(self.epoch)[self.cursor])
        self.cursor += 1
        if self.cursor == len(self.folder):
            self.epoch, self.cursor = self.epoch + 1, 0
        return [PackItem(key=(*position, k), length=s.length, payload=s) for k, s in enumerate(self.folder.pack(pack))]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "buffer": []}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
