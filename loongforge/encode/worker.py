"""One ``loongforge encode`` process: its encoder, and its shards written one by one.

A process needs no collective: its shards are fixed by the plan (``encode.plan``), so N processes
on a node each build a whole encoder (megatron-core state of a world of one) and write their own
shards. A shard's media are decoded exactly as training decodes them (``data.measure``), encoded
in batches of at most ``batch_patches`` patches (a batch never splits a medium; attention never
crosses media, so batching does not change the features) and written whole, or not at all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save

from loongforge.config.schema import ParallelConfig, RunConfig
from loongforge.convert.model_io import build_loaded_encoder
from loongforge.data.collate import stacked_facts
from loongforge.data.embedding_store import FORMAT, SHARD_METADATA_KEY, EmbeddingRow, media_source_key, shard_name
from loongforge.data.measure import image_pixels, video_pixels, vision_sizing
from loongforge.data.packfile.folder import write_atomic
from loongforge.data.samples import Reject
from loongforge.data.vision import MediaError
from loongforge.encode.plan import EncodeItem, EncodePlan
from loongforge.models.media import MediaSet
from loongforge.models.vlm.fingerprint import weights_digest
from loongforge.parallel.distributed import init_model_parallel, resolve_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (rank, shard number, media in it) after each shard this run writes is on disk; tests use it to stop a run at a
# known point, the CLI to move the progress bar.
ShardDone = Callable[[int, int, int], None]


@dataclass(frozen=True)
class WorkerSpec:
    """What every process needs to do its part (picklable: it travels to spawned workers)."""

    cfg: RunConfig
    root: Path
    plan: EncodePlan
    world_size: int
    dtype: str
    weights: Optional[str]  # HF folder or loongforge checkpoint; None: the preset's initial weights
    device: str
    shard_tokens: int
    batch_patches: int
    threads: int


def run_rank(spec: WorkerSpec, rank: int, on_shard: Optional[ShardDone] = None) -> str:
    """Write this rank's missing shards; returns the encoder's weights digest."""
    torch.set_num_threads(spec.threads)
    device = _init_world_of_one(spec)
    encoder = build_loaded_encoder(spec.cfg.model, init_seed=spec.cfg.training.seed, device=device,
                                   weights=spec.weights)
    digest = weights_digest(encoder)  # of the weights as loaded (fp32), which training recomputes
    encoder = encoder.to(dtype=DTYPES[spec.dtype])
    merge_unit = spec.cfg.model.projector.spatial_merge_size ** 2
    shards = spec.plan.shards(rank, spec.world_size, merge_unit=merge_unit, shard_tokens=spec.shard_tokens)
    for number, items in enumerate(shards):
        path = spec.root / shard_name(rank, number)
        if path.exists():
            continue  # written before an interruption
        _write_shard(path, shard_name(rank, number), items, encoder, spec, device)
        if on_shard is not None:
            on_shard(rank, number, len(items))
    return digest


def _init_world_of_one(spec: WorkerSpec) -> torch.device:
    """A process group of this process alone, and megatron's TP = PP = 1 state on it."""
    device = resolve_device(spec.device)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_model_parallel(ParallelConfig(), seed=spec.cfg.training.seed, device=device)
    return device


@torch.no_grad()
def _write_shard(path: Path, name: str, items: list[EncodeItem], encoder, spec: WorkerSpec,
                 device: torch.device) -> None:
    sizing = vision_sizing(spec.cfg.data, spec.cfg.model)
    decoded, rejects = [], []
    for item in items:
        try:
            decoded.append((item, _pixels(item, sizing)))
        except MediaError as error:
            reject = Reject.of(item, error.reason, f"{item.kind} {item.media_index}: {error.detail}")
            rejects.append({"sample_order": item.sample_order, **reject.to_json()})
    tensors, rows = {}, []
    for batch in _batches(decoded, spec.batch_patches):
        features = _encode(encoder, batch, device, spec.cfg.model)
        for (item, _), feature in zip(batch, features):
            key = f"{item.kind}:{item.order}"
            tensors[key] = feature.to(DTYPES[spec.dtype]).cpu().contiguous()
            rows.append(EmbeddingRow(sample_id=item.sample_id, file=os.path.abspath(item.file), record=item.record,
                                     line=item.line, kind=item.kind, source=media_source_key(item.source),
                                     order=item.order, sample_order=item.sample_order,
                                     media_index=item.media_index, grid=item.grid, tokens=feature.shape[0],
                                     shard=name, key=key).to_json())
    # One metadata key: safetensors writes a header's keys in hash order, and a shard rewritten
    # after --resume must be byte-identical to the first.
    header = {"format": FORMAT, "rows": rows, "rejects": rejects}
    write_atomic(path, save(tensors, metadata={SHARD_METADATA_KEY: json.dumps(header)}))


def _pixels(item: EncodeItem, sizing) -> np.ndarray:
    if item.kind == "image":
        return image_pixels(item.source, item.grid, sizing, item.images_in_sample)
    return video_pixels(item.source, item.video_plan, sizing)


def _batches(decoded: list, batch_patches: int) -> list[list]:
    """Consecutive media, each batch at most ``batch_patches`` patches (or one larger medium)."""
    batches, current, patches = [], [], 0
    for item, pixels in decoded:
        if current and patches + item.patches > batch_patches:
            batches.append(current)
            current, patches = [], 0
        current.append((item, pixels))
        patches += item.patches
    return batches + ([current] if current else [])


def _encode(encoder, batch: list, device: torch.device, model_cfg) -> list[torch.Tensor]:
    """Features [tokens_i, hidden] of each medium of the batch: the placeholders' features, as the encoder
    gives them for a set of images (packed by each image's size where it reads images whole)."""
    dtype = next(encoder.parameters()).dtype
    media = MediaSet(
        grids=torch.tensor([item.grid for item, _ in batch], dtype=torch.long, device=device),  # [n, 3]
        rows=torch.from_numpy(np.concatenate([p for _, p in batch])).to(device=device, dtype=dtype),  # [P, D]
        sizes=torch.tensor([item.size for item, _ in batch], dtype=torch.long, device=device),  # [n, 2]
        facts=stacked_facts([item.facts for item, _ in batch], len(batch), device))
    if not encoder.reads_items:
        features = encoder(media.rows, media.grids)  # [P / merge_unit, hidden]
        return list(features.split([item.patches // encoder.merge_unit for item, _ in batch]))
    rows = [type(encoder).feature_rows(model_cfg, _one(media, i), encoder.merge_unit) for i in range(len(batch))]
    rows = [item.patches // encoder.merge_unit if count is None else count for count, (item, _) in zip(rows, batch)]
    return list(encoder.encode_images(media).split(rows))  # [tokens, hidden] per image


def _one(media: MediaSet, index: int) -> MediaSet:
    """Item ``index`` of ``media`` as a set of one (its grid, size and facts; no rows: counts only)."""
    return MediaSet(grids=media.grids[index:index + 1], sizes=media.sizes[index:index + 1],
                    facts={name: value[index:index + 1] for name, value in media.facts.items()})


def default_threads(world_size: int) -> int:
    """Intra-op threads per process: the node's cores shared out."""
    return max(1, (os.cpu_count() or 1) // world_size)
