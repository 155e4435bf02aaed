"""A micro-batch dict (``data.collate`` contract) -> the cost model's per-sample and summed features.

Images and videos are assigned to samples in token order: each one occupies
``t*h*w / merge^2`` pad tokens inside exactly one sample's span of ``input_ids``.
"""

from __future__ import annotations

import numpy as np
import torch

from loongforge.balance.cost_model import TERMS, SampleCost, batch_features
from loongforge.config.schema import ModelConfig


def _media_grids(grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    if grid_thw is None:
        return []
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def sample_costs(micro_batch: dict, *, image_token_id: int, video_token_id: int,
                 merge_size: int) -> list[SampleCost]:
    """One SampleCost per real sample (padding excluded) with the patches (and grids) of its
    images/videos and its loss tokens."""
    lengths = [int(n) for n in micro_batch["sample_lengths"]]
    ids = micro_batch["input_ids"].reshape(-1)
    bounds = np.cumsum([0, *lengths])
    loss_mask = micro_batch["loss_mask"].reshape(-1)
    loss = [int(loss_mask[bounds[i]:bounds[i + 1]].sum()) for i in range(len(lengths))]
    merge = merge_size * merge_size
    grids: list[list[tuple[int, int, int]]] = [[] for _ in lengths]
    for token_id, grid_thw in ((image_token_id, micro_batch.get("image_grid_thw")),
                               (video_token_id, micro_batch.get("video_grid_thw"))):
        media = _media_grids(grid_thw)
        if not media:
            continue
        # Count this media kind's pad tokens per sample, then hand out media in order.
        starts = np.cumsum([0, *lengths])
        pads = [int((ids[starts[i]:starts[i + 1]] == token_id).sum()) for i in range(len(lengths))]
        sample = 0
        for grid in media:
            p = grid[0] * grid[1] * grid[2]
            while sample < len(lengths) and pads[sample] < p // merge:
                sample += 1
            if sample == len(lengths):
                raise ValueError(f"micro-batch has more {token_id} media than pad tokens; "
                                 f"grids {media}, pads per sample {pads}")
            grids[sample].append(grid)
            pads[sample] -= p // merge
    return [SampleCost(tokens=L, patches=tuple(t * h * w for t, h, w in gs), loss_tokens=n, grids=tuple(gs))
            for L, gs, n in zip(lengths, grids, loss)]


def model_sample_costs(micro_batch: dict, model_cfg: ModelConfig) -> list[SampleCost]:
    """``sample_costs`` with the token ids and merge size of ``model_cfg`` (a text-only model
    has no media to place)."""
    merge = model_cfg.projector.spatial_merge_size if model_cfg.projector else 1
    return sample_costs(micro_batch, image_token_id=model_cfg.tokens.image_token_id,
                        video_token_id=model_cfg.tokens.video_token_id, merge_size=merge)


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
