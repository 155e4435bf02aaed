"""One packed row -> one micro-batch dict: the contract with the training loop.

Keys (T = real tokens rounded up to ``pad_to_multiple``; padding is at the end; with
``sample_multiple`` > 1, context parallelism's 2 x CP, each sample is first padded to a multiple of it
inside its own segment, and "real tokens" counts that padding too):

==================== ============================ ==============================================
input_ids            LongTensor[1, T]             token ids; padding = model.tokens.pad_token_id
labels               LongTensor[1, T]             labels[t] = input_ids[t+1] of the same sample;
                                                  0 at each sample's last token and on padding
loss_mask            FloatTensor[1, T]            1 where labels[t] is an assistant answer token
                                                  (or its <|im_end|>), else 0
padding_mask         BoolTensor[1, T]             True on padding, the tail and samples' own (kept out of the
                                                  mixture-of-experts routers' statistics)
position_ids         LongTensor[3, 1, T]          M-RoPE (temporal, height, width) per sample,
                                                  restarting at 0; padding counts 0, 1, 2, ...
cu_seqlens           IntTensor[n_segments + 1]    int32 sample boundaries over T; the padding
                                                  tail, if any, is its own last segment
media                MediaBatch                   the row's images then videos in token order
                                                  (``models.media``): per modality a MediaSet of
                                                  patch rows [P, patch_dim], grids [n, 3], sizes
                                                  [n, 2] (pixels; None where not kept), the
                                                  processor's facts by name, each medium's sample
                                                  index in the row; with data.vision_embeddings
                                                  stored features instead of rows. Empty (falsy)
                                                  for a row without media
num_loss_tokens      int                          loss_mask.sum()
sample_lengths       list[int]                    real tokens per sample (sum = real length)
sample_ids           list[str]                    "<file>[<record>]" or "synthetic:<index>"
==================== ============================ ==============================================
"""

from __future__ import annotations

import numpy as np
import torch

from loongforge.data.measure import MaterializedSample
from loongforge.data.packing import padded_length
from loongforge.models.family import PositionIds
from loongforge.models.media import SECONDS_PER_GRID_T, MediaBatch, MediaSet


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def collate_row(
    row: list[MaterializedSample], *, pad_to_multiple: int, pad_token_id: int, position_ids: PositionIds,
    sample_multiple: int = 1,
) -> dict:
    """``position_ids``: the model family's per-sample rotary positions
    (``ModelFamily.position_ids(model_cfg)``). ``sample_multiple``: each sample's segment is padded
    to a multiple of it (the packer counted it so, ``data.packing.padded_length``); its padding
    continues the sample's positions (the last one + 1, 2, ... on every axis), trains nothing and is
    attended by nothing of the sample (it comes after it)."""
    if not row:
        raise ValueError("cannot collate an empty row")
    ids, labels, loss_mask, positions, padding, real_lengths = [], [], [], [], [], []
    for item in row:
        sample_ids, sample_labels, sample_mask = _shifted_targets(item)
        real_lengths.append(len(sample_ids))
        sample_positions = _sample_positions(item, position_ids)  # [3, L]
        pad = padded_length(len(sample_ids), sample_multiple) - len(sample_ids)
        if pad:
            sample_ids = torch.cat([sample_ids, torch.full((pad,), pad_token_id, dtype=torch.long)])
            sample_labels = torch.cat([sample_labels, torch.zeros(pad, dtype=torch.long)])
            sample_mask = torch.cat([sample_mask, torch.zeros(pad, dtype=torch.float32)])
            following = sample_positions[:, -1:] + torch.arange(1, pad + 1)  # [3, pad]
            sample_positions = torch.cat([sample_positions, following], dim=1)
        padding.append(torch.arange(len(sample_ids)) >= real_lengths[-1])
        ids.append(sample_ids)
        labels.append(sample_labels)
        loss_mask.append(sample_mask)
        positions.append(sample_positions)
    lengths = [len(t) for t in ids]  # segments: samples with their own padding
    real_len = sum(lengths)
    total_len = round_up(real_len, pad_to_multiple)
    pad_len = total_len - real_len
    if pad_len:
        padding.append(torch.ones(pad_len, dtype=torch.bool))
        ids.append(torch.full((pad_len,), pad_token_id, dtype=torch.long))
        labels.append(torch.zeros(pad_len, dtype=torch.long))
        loss_mask.append(torch.zeros(pad_len, dtype=torch.float32))
        positions.append(torch.arange(pad_len).expand(3, -1))
    boundaries = np.cumsum([0, *lengths, *([pad_len] if pad_len else [])])
    loss_mask_t = torch.cat(loss_mask)[None]  # [1, T]
    return {
        "input_ids": torch.cat(ids)[None],  # [1, T]
        "labels": torch.cat(labels)[None],  # [1, T]
        "loss_mask": loss_mask_t,
        "padding_mask": torch.cat(padding)[None],  # [1, T]
        "position_ids": torch.cat(positions, dim=1)[:, None, :].contiguous(),  # [3, 1, T]
        "cu_seqlens": torch.as_tensor(boundaries, dtype=torch.int32),  # [n_segments + 1]
        "media": row_media(row),
        "num_loss_tokens": int(loss_mask_t.sum().item()),
        "sample_lengths": real_lengths,
        "sample_ids": [item.sample.sample_id for item in row],
    }


def _shifted_targets(item: MaterializedSample) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [L], labels [L], loss_mask [L]) with targets shifted inside the sample."""
    ids = torch.from_numpy(item.sample.input_ids).long()
    labels = torch.zeros_like(ids)
    labels[:-1] = ids[1:]
    loss_mask = torch.zeros(len(ids), dtype=torch.float32)
    if item.late_reject is None:  # a sample whose media failed to decode trains nothing
        loss_mask[:-1] = torch.from_numpy(item.sample.is_answer[1:]).float()
    return ids, labels, loss_mask


def _sample_positions(item: MaterializedSample, position_ids: PositionIds) -> torch.Tensor:
    sample = item.sample
    return position_ids(
        torch.from_numpy(sample.input_ids).long(),
        torch.tensor(sample.image_grids, dtype=torch.long) if sample.image_grids else None,
        torch.tensor([p.grid_thw for p in sample.video_plans], dtype=torch.long) if sample.video_plans else None,
        [p.second_per_grid_t for p in sample.video_plans] if sample.video_plans else None,
    )  # [3, L]


def row_media(row: list[MaterializedSample]) -> MediaBatch:
    """The row's media as one ``MediaBatch`` (empty without any)."""
    return MediaBatch(images=_images(row), videos=_videos(row))


def _images(row: list[MaterializedSample]):
    grids = [g for item in row for g in item.sample.image_grids]
    if not grids:
        return None
    return MediaSet(
        grids=torch.tensor(grids, dtype=torch.long),  # [n, 3]
        rows=_cat([torch.from_numpy(p) for item in row for p in item.image_pixels]),  # [P, patch_dim]
        features=_cat([e for item in row for e in item.image_embeds]),
        sizes=_image_sizes(row, len(grids)),
        facts=stacked_facts([f for item in row for f in item.sample.image_facts], len(grids)),
        samples=tuple(index for index, item in enumerate(row) for _ in item.sample.image_grids))


def _videos(row: list[MaterializedSample]):
    plans = [plan for item in row for plan in item.sample.video_plans]
    if not plans:
        return None
    return MediaSet(
        grids=torch.tensor([p.grid_thw for p in plans], dtype=torch.long),  # [n, 3]
        rows=_cat([torch.from_numpy(p) for item in row for p in item.video_pixels]),
        features=_cat([e for item in row for e in item.video_embeds]),
        facts={SECONDS_PER_GRID_T: torch.tensor([p.second_per_grid_t for p in plans], dtype=torch.float32)},
        samples=tuple(index for index, item in enumerate(row) for _ in item.sample.video_plans))


def _image_sizes(row: list[MaterializedSample], images: int):
    sizes = [size for item in row for size in item.sample.image_sizes]
    # None where a folder packed before sizes were kept lacks some (a tower that needs them says so).
    return torch.tensor(sizes, dtype=torch.long) if len(sizes) == images else None  # [n, 2]


def stacked_facts(facts: list, images: int, device=None) -> dict:
    """The images' processor facts (one mapping per image) as one tensor per name, [n, ...]; {} unless every
    one of the ``images`` has them (a processor gives the same names for every image; a tower that needs them
    says so)."""
    if len(facts) != images or not all(facts):
        return {}
    return {name: torch.tensor([f[name] for f in facts], device=device) for name in facts[0]}


def _cat(tensors: list[torch.Tensor]):
    return torch.cat(tensors) if tensors else None
