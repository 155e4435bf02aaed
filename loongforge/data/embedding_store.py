"""A folder of stored vision embeddings (``loongforge encode``'s output) and how to read it.

    encode_job.json   what produced the folder (inputs, preset, weights, settings); --resume
                      refuses a different one
    shards/r<rank>-<n>.safetensors
                      the merged features of some images/videos, one tensor each
                      [tokens, LM hidden]; the header's metadata lists their index rows and the
                      media of the shard that could not be decoded. A shard is written whole
                      (tmp + rename) or not at all: it is the unit --resume skips.
    index.jsonl       one row per stored medium, in input order (``EmbeddingRow``)
    rejects.jsonl     samples whose media could not be read, with file, record, line and reason
    encoder.json      written last (its presence marks a finished folder): the preset, the
                      digest of the encoder + merger weights, the processor settings, counts
    runs.jsonl        one line per `encode` call that wrote here: media encoded, seconds, processes

A medium is found by its sample's file and record (its ordinal there, as training names samples:
``samples.sample_id_of``), its kind (image or video), its index among that sample's media of that
kind and its source (the file it is read from, or a digest of inline bytes). Not by line: the
records of a JSON array on one line share it, and the same image beside another may have other
features than alone (LLaVA-OneVision packs a lone image with its anyres crops).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from loongforge.config.errors import InputError
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.measure import MaterializedSample, MeasuredSample, vision_sizing
from loongforge.data.samples import Reject

# 2: media keyed by their sample's record, not its line (1; a folder of 1 is refused: encode again).
FORMAT = "loongforge-embeddings/2"
JOB_FILE = "encode_job.json"
ENCODER_FILE = "encoder.json"
INDEX_FILE = "index.jsonl"
REJECTS_FILE = "rejects.jsonl"
RUNS_FILE = "runs.jsonl"
SHARD_DIR = "shards"
KINDS = ("image", "video")
# The shard header's metadata entry: JSON {"format", "rows": index rows, "rejects": rejects}.
SHARD_METADATA_KEY = "loongforge"


def shard_name(rank: int, number: int) -> str:
    """A shard's path relative to the folder, as index rows record it."""
    return f"{SHARD_DIR}/r{rank:03d}-{number:06d}.safetensors"


@dataclass(frozen=True)
class EmbeddingRow:
    """Where one image's or video's stored features are."""

    sample_id: str
    file: str  # absolute
    record: Optional[int]  # the sample's ordinal in its file (ConversationSample.record)
    line: int  # where the sample starts, for people
    kind: str  # "image" or "video"
    media_index: int  # among the sample's media of this kind
    source: str  # ``media_source_key`` of the image or video
    order: int  # the medium's position in the input
    sample_order: int  # its sample's position in the input
    grid: tuple[int, int, int]  # (t, h, w) patches
    tokens: int  # rows of the stored tensor: t*h*w / merge_unit
    shard: str
    key: str

    def to_json(self) -> dict:
        record = asdict(self)
        record["grid"] = list(self.grid)
        return record

    @staticmethod
    def from_json(record: dict) -> "EmbeddingRow":
        return EmbeddingRow(**{**record, "grid": tuple(record["grid"])})


def media_source_key(source) -> str:
    """What names an image or video across runs: its file's absolute path, or the sha256 of its
    inline bytes. In-memory images (synthetic data) have no stable name."""
    if isinstance(source, (str, Path)):
        return os.path.abspath(source)
    if isinstance(source, (bytes, bytearray)):
        return "sha256:" + hashlib.sha256(source).hexdigest()
    raise ValueError(f"an in-memory {type(source).__name__} has no name to store its embedding under")


def stored_feature_width(model_cfg: ModelConfig) -> int:
    """Features stored per LLM token: the merger's (the language model's width), then one set per
    DeepStack level (Qwen3-VL), concatenated."""
    levels = 1 + (len(model_cfg.vision.deepstack_layers) if model_cfg.vision is not None else 0)
    return model_cfg.language.hidden_size * levels


def processor_settings(data_cfg: DataConfig, model_cfg: ModelConfig) -> dict:
    """Everything that decides the pixels the encoder sees: two runs agreeing on this dict
    preprocess every image and video alike."""
    # Through JSON and back, so a settings dict read from encoder.json compares equal (lists, not tuples).
    sizing = json.loads(json.dumps(vision_sizing(data_cfg, model_cfg).settings()))
    return {"vision_sizing": sizing,
            "video_fps": data_cfg.video_fps, "video_max_frames": data_cfg.video_max_frames}


class EmbeddingStore:
    """A finished ``loongforge encode`` folder: its ``encoder.json`` and lookups by sample."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        encoder_file = self.root / ENCODER_FILE
        if not encoder_file.is_file():
            raise InputError(f"{self.root}: not a finished `loongforge encode` folder (no {ENCODER_FILE}); "
                             f"finish it with `loongforge encode ... --output {self.root} --resume`")
        self.encoder = json.loads(encoder_file.read_text())
        if self.encoder.get("format") != FORMAT:
            raise InputError(f"{self.root} was written by an older `loongforge encode` ({self.encoder.get('format')}, "
                             f"not {FORMAT}: media found by line, which records of a JSON array can share); "
                             f"encode again with --overwrite")
        # Media by (absolute file, record, kind, media index, source): see the module docstring.
        self._rows: dict[tuple, EmbeddingRow] = {}
        with open(self.root / INDEX_FILE, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = EmbeddingRow.from_json(json.loads(line))
                    self._rows[(row.file, row.record, row.kind, row.media_index, row.source)] = row
        self._open: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self, sample: MeasuredSample) -> tuple[list[Optional[EmbeddingRow]], list[Optional[EmbeddingRow]]]:
        """The stored rows of the sample's images and of its videos (None where one is missing)."""
        file = os.path.abspath(sample.file)

        def find(kind: str, index: int, source) -> Optional[EmbeddingRow]:
            try:
                key = media_source_key(source)
            except ValueError:
                return None
            return self._rows.get((file, sample.record, kind, index, key))

        return ([find("image", i, image) for i, image in enumerate(sample.images)],
                [find("video", i, video) for i, video in enumerate(sample.videos)])

    def problem(self, sample: MeasuredSample) -> Optional[str]:
        """Why ``sample``'s media are not all stored as this run measures them, or None."""
        images, videos = self.rows(sample)
        wanted = [("image", row, tuple(grid)) for row, grid in zip(images, sample.image_grids)]
        wanted += [("video", row, tuple(plan.grid_thw)) for row, plan in zip(videos, sample.video_plans)]
        for index, (kind, row, grid) in enumerate(wanted):
            if row is None:
                return f"{kind} {index if kind == 'image' else index - len(images)} is not stored in {self.root}"
            if row.grid != grid:
                return f"{kind} {row.media_index}: stored for grid {list(row.grid)}, this run measures {list(grid)}"
        return None

    def materialize(self, sample: MeasuredSample, width: int, image_tokens: list[int]) -> MaterializedSample:
        """The sample with its stored features in place of pixels; without them, zero features
        of the right shape (``image_tokens``: each image's placeholders, ``measure.image_tokens``) and a
        ``missing_embedding`` late reject (its row slot trains nothing)."""
        problem = self.problem(sample)
        if problem is None:
            images, videos = self.rows(sample)
            return MaterializedSample(sample=sample, image_pixels=[], video_pixels=[],
                                      image_embeds=[self.features(r) for r in images],
                                      video_embeds=[self.features(r) for r in videos])
        merge_unit = self.encoder["processor"]["vision_sizing"]["merge_size"] ** 2
        zeros = lambda grid: torch.zeros(grid[0] * grid[1] * grid[2] // merge_unit, width)  # noqa: E731
        return MaterializedSample(
            sample=sample, image_pixels=[], video_pixels=[],
            image_embeds=[torch.zeros(tokens, width) for tokens in image_tokens],
            video_embeds=[zeros(p.grid_thw) for p in sample.video_plans],
            late_reject=Reject.of(sample, "missing_embedding",
                                  f"{problem} (found when loading; sample trained with no loss)"))

    def features(self, row: EmbeddingRow) -> torch.Tensor:
        """[tokens, hidden] stored features of one medium, in the stored dtype."""
        handle = self._open.get(row.shard)
        if handle is None:
            handle = self._open[row.shard] = safe_open(str(self.root / row.shard), framework="pt")
        return handle.get_tensor(row.key)


class StoredMediaMeasurer:
    """A ``SampleMeasurer`` that also rejects (``missing_embedding``) a sample whose media are not
    all in the store, before it is packed: its row room goes to samples that can train."""

    def __init__(self, measurer, store: EmbeddingStore):
        self.measurer = measurer
        self.store = store

    def measure(self, sample):
        measured = self.measurer.measure(sample)
        if isinstance(measured, Reject):
            return measured
        problem = self.store.problem(measured)
        if problem is None:
            return measured
        return Reject.of(measured, "missing_embedding", problem)
