"""Hugging Face checkpoint folders: read tensor by tensor, write shard by shard, never whole.

Reading is one tensor at a time, straight from the byte range the header names into memory the
tensor owns (no memory map: mapped pages would count toward peak RSS for as long as anything of
the file is referenced). Headers are parsed up front so that a truncated
file, a shard named in the index but absent, or a tensor of the wrong shape is reported before
anything is written.

Writing uses the safetensors layout directly (8-byte little-endian header length, JSON header,
raw little-endian bytes): the header is computed from the planned names, dtypes and shapes, then
each tensor's bytes are appended as it is produced, so a 5 GB shard never sits in memory. Which file
each tensor goes to is the folder's converted from where it is known (``FileLayout``: HF -> megatron -> HF
gives back the files read), else shards of a maximum size.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from loongforge.config.errors import InputError
from loongforge.config.schema import ModelConfig
from loongforge.models.registry import family_of_hf_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Kept beside a converted checkpoint's config.json: which file of the HF folder held each tensor.
LAYOUT_FILE = "safetensors_layout.json"
DEFAULT_SHARD_BYTES = 5 * 10**9

# safetensors dtype names <-> torch dtypes (those a checkpoint of this family can hold).
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    key: str  # the name as stored in the file (either key style)
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the first byte in the file

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        (path / INDEX_FILE).is_file() or any(path.glob("*.safetensors")))


def read_header(file: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file, checked against the file's length, and the offset of
    its data section."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise InputError(f"{file}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise InputError(f"{file}: truncated safetensors file (header of {header_len} bytes, "
                                 f"file of {size})")
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise InputError(f"{file}: file not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputError(f"{file}: not a safetensors file (unreadable header)") from None
    data_len = size - 8 - header_len
    for key, info in header.items():
        if key == "__metadata__":
            continue
        end = info["data_offsets"][1]
        if end > data_len:
            raise InputError(f"{file}: truncated safetensors file: tensor {key} ends at byte {end} of the "
                             f"data section but the file holds {data_len}; re-download or re-export it")
    return header, 8 + header_len


class HFCheckpoint:
    """An HF model folder: ``config.json`` plus one safetensors file or an index of shards.

    Tensors are addressed by their Hub-style names whichever style the files use (the renaming is
    the family's, the family the one ``config.json`` names).
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        config_file = self.root / "config.json"
        if not config_file.is_file():
            raise InputError(f"{self.root}: no config.json; an HF checkpoint folder needs one")
        try:
            self.config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise InputError(f"{config_file}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
        self.family = family_of_hf_config(self.config, str(config_file))
        self.entries = self._scan()

    def model_config(self) -> ModelConfig:
        """The model this folder's config.json and tensors describe (``ModelFamily.config_for_tensors``)."""
        model_cfg = self.family.config_from_hf(self.config, str(self.root / "config.json"))
        return self.family.config_for_tensors(model_cfg, self.entries.keys())

    def _files(self) -> dict[str, list[str]]:
        """File name -> tensor names it should hold according to the index (None: from headers)."""
        index = self.root / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            by_file: dict[str, list[str]] = {}
            for key, name in weight_map.items():
                by_file.setdefault(name, []).append(key)
            return by_file
        files = sorted(p.name for p in self.root.glob("*.safetensors"))
        if not files:
            raise InputError(f"{self.root}: no *.safetensors files and no {INDEX_FILE}")
        return {name: [] for name in files}

    def _scan(self) -> dict[str, TensorEntry]:
        entries: dict[str, TensorEntry] = {}
        for name, indexed_keys in self._files().items():
            file = self.root / name
            if not file.is_file():
                first = indexed_keys[0] if indexed_keys else "?"
                raise InputError(f"{file}: shard named in {INDEX_FILE} is missing (it holds {first} and "
                                 f"{len(indexed_keys) - 1} more tensors)")
            header, data_start = read_header(file)
            for key in indexed_keys:
                if key not in header:
                    raise InputError(f"{file}: tensor {key} is listed in {INDEX_FILE} but not in the file")
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if info["dtype"] not in _ST_DTYPES:
                    raise InputError(f"{file}: tensor {key} has unsupported dtype {info['dtype']}")
                hub_key = next(iter(self.family.to_hub_style({key: None})))
                entries[hub_key] = TensorEntry(file, key, _ST_DTYPES[info["dtype"]], tuple(info["shape"]),
                                               data_start + info["data_offsets"][0])
        return entries

    def layout(self) -> "FileLayout":
        """Which file holds each tensor the family reads (Hub-style names), and whether the folder has an index."""
        files = {key: entry.file.name for key, entry in self.entries.items() if not key.startswith(self.family.hf_unread)}
        return FileLayout(files, (self.root / INDEX_FILE).is_file())

    def side_files(self, names: Iterable[str]) -> list[Path]:
        return [self.root / n for n in names if (self.root / n).is_file()]

    def load(self, hub_key: str) -> torch.Tensor:
        """One tensor, read into memory of its own (not memory-mapped: mapped pages of a file would
        count toward the process's memory for as long as any tensor of it is alive)."""
        entry = self.entries[hub_key]
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
        with open(entry.file, "rb") as f:
            f.seek(entry.offset)
            read = f.readinto(memoryview(buffer.numpy())) if entry.nbytes else 0
        if read != entry.nbytes:
            raise InputError(f"{entry.file}: truncated safetensors file: tensor {entry.key} has "
                             f"{read} of its {entry.nbytes} bytes")
        # safetensors stores little-endian, like torch's CPU tensors on x86 and arm
        return buffer.view(entry.dtype).reshape(entry.shape)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / '1000' -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    value = text.strip().upper()
    number = value.rstrip("KMGTIB")
    unit = value[len(number):]
    if unit not in units or not number:
        raise ValueError(f"cannot read size {text!r}; use e.g. 5GB, 500MB or 2GiB")
    return int(float(number) * units[unit])


@dataclass(frozen=True)
class PlannedTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


@dataclass(frozen=True)
class FileLayout:
    """The files of an HF folder an export reproduces: Hub-style tensor name -> the file holding it, and
    whether the folder has ``INDEX_FILE`` (``save_pretrained`` writes none for a single file)."""

    files: dict[str, str]
    indexed: bool

    def write(self, file: Path) -> None:
        file.write_text(json.dumps({"indexed": self.indexed, "files": self.files}, indent=1) + "\n")

    @classmethod
    def read(cls, file: Path) -> "FileLayout | None":
        if not file.is_file():
            return None
        layout = json.loads(file.read_text())
        return cls(layout["files"], layout["indexed"])


@dataclass(frozen=True)
class ShardPlan:
    shards: list[list[PlannedTensor]]
    names: list[str]
    indexed: bool  # write ``INDEX_FILE`` beside the shards


def plan_files(tensors: list[PlannedTensor], layout: "FileLayout | None", max_shard_bytes: int) -> ShardPlan:
    """The files of the source folder where ``layout`` places exactly ``tensors`` (HF -> megatron -> HF gives
    back the files read); otherwise shards of at most ``max_shard_bytes`` and an index."""
    if layout is None or set(layout.files) != {t.key for t in tensors}:
        shards = plan_shards(tensors, max_shard_bytes)
        return ShardPlan(shards, shard_names(len(shards)), True)
    names = sorted(set(layout.files.values()))
    shards = [[t for t in tensors if layout.files[t.key] == name] for name in names]
    return ShardPlan(shards, names, layout.indexed)


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Consecutive groups of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return [s for s in shards if s]


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class SafetensorsStreamWriter:
    """Write one safetensors file whose tensors are known up front and arrive one at a time."""

    def __init__(self, path: Path, tensors: list[PlannedTensor]):
        self.path = path
        self.expected = [(t.key, t.dtype, t.shape) for t in tensors]
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for t in tensors:
            header[t.key] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)
        self.position = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        expected_key, dtype, shape = self.expected[self.position]
        if (key, tensor.dtype, tuple(tensor.shape)) != (expected_key, dtype, shape):
            raise RuntimeError(f"{self.path}: expected {expected_key} {dtype} {shape}, got {key} "
                               f"{tensor.dtype} {tuple(tensor.shape)}")
        data = tensor.detach().contiguous().reshape(-1)
        # bytes through a uint8 view (no numpy: it has no bfloat16); little-endian like torch on x86/arm
        self.file.write(memoryview(data.view(torch.uint8).numpy()))
        self.position += 1

    def close(self) -> None:
        self.file.close()
        if self.position != len(self.expected):
            raise RuntimeError(f"{self.path}: {len(self.expected) - self.position} tensors were never written")


def write_index(root: Path, shards: list[list[PlannedTensor]], names: list[str]) -> None:
    """``model.safetensors.index.json``, with the metadata ``save_pretrained`` writes."""
    weight_map = {t.key: name for shard, name in zip(shards, names) for t in shard}
    tensors = [t for shard in shards for t in shard]
    metadata = {"total_parameters": sum(math.prod(t.shape) for t in tensors), "total_size": sum(t.nbytes for t in tensors)}
    (root / INDEX_FILE).write_text(json.dumps(
        {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")

