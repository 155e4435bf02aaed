"""A micro-batch dict (``data.collate`` contract) -> the cost model's per-sample and summed features.

Each image and video belongs to the sample the batch says it does (``MediaSet.samples``: a sample's
index in the row per medium), whatever its placeholder count (a tower
such as LLaVA-OneVision's packs an image into fewer tokens than its patches).
"""

from __future__ import annotations

import numpy as np

from loongforge.balance.cost_model import TERMS, SampleCost, batch_features
from loongforge.config.schema import ModelConfig
from loongforge.models.media import MediaBatch, MediaSet


def _media_sets(media: MediaBatch | None) -> list[MediaSet]:
    return [] if media is None else [m for m in (media.images, media.videos) if m is not None]


def sample_costs(micro_batch: dict) -> list[SampleCost]:
    """One SampleCost per real sample (padding excluded) with the patches (and grids) of its
    images/videos and its loss tokens."""
    lengths = [int(n) for n in micro_batch["sample_lengths"]]
    bounds = np.cumsum([0, *lengths])
    loss_mask = micro_batch["loss_mask"].reshape(-1)
    loss = [int(loss_mask[bounds[i]:bounds[i + 1]].sum()) for i in range(len(lengths))]
    grids: list[list[tuple[int, int, int]]] = [[] for _ in lengths]
    for media in _media_sets(micro_batch.get("media")):
        if len(media.samples) != len(media):
            raise ValueError(f"micro-batch has {len(media)} media of a kind but names the samples of "
                             f"{len(media.samples)}")
        for sample, grid in zip(media.samples, media.grids.tolist()):
            grids[sample].append(tuple(grid))
    return [SampleCost(tokens=L, patches=tuple(t * h * w for t, h, w in gs), loss_tokens=n, grids=tuple(gs))
            for L, gs, n in zip(lengths, grids, loss)]


def model_sample_costs(micro_batch: dict, model_cfg: ModelConfig) -> list[SampleCost]:
    """``sample_costs`` (the model's settings no longer enter: the batch names each medium's sample)."""
    return sample_costs(micro_batch)


def micro_batch_record(micro_batch: dict, samples: list[SampleCost]) -> dict:
    """The feature part of a ``micro_batch`` record."""
    features = batch_features(samples)
    return {
        "samples": [{"L": s.tokens, "patches": list(s.patches), "loss": s.loss_tokens,
                     "grids": [list(grid) for grid in s.grids]} for s in samples],
        "features": {t: float(v) for t, v in zip(TERMS, features)},
        "tokens_padded": int(micro_batch["input_ids"].numel()),
        "loss_tokens": int(micro_batch.get("num_loss_tokens", 0)),
    }


def record_samples(record: dict) -> list[SampleCost]:
    """The samples of a ``micro_batch`` record (``micro_batch_record``'s inverse). Records written
    before grids were kept have none (their vision FLOPs cannot be counted)."""
    return [SampleCost(tokens=int(s["L"]), patches=tuple(int(p) for p in s["patches"]), loss_tokens=int(s["loss"]),
                       grids=tuple(tuple(int(n) for n in grid) for grid in s.get("grids", ())))
            for s in record["samples"]]
