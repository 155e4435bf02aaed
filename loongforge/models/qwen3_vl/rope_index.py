"""Interleaved M-RoPE position ids of one Qwen3-VL sample (temporal, height, width).

The ids are Qwen2.5-VL's with one change: a video is a run of frames, each its own block of
placeholder tokens (the processor writes ``<t seconds> <vision_start> frame <vision_end>`` per
temporal patch), and every frame is positioned like a one-frame image. Time reaches the model
through the timestamp text, not through temporal ids, so ``second_per_grid_ts`` is not used.
"""

from __future__ import annotations

import functools

import torch

from loongforge.config.schema import ModelConfig


def position_ids_for(model_cfg: ModelConfig):
    """``get_rope_index`` with this model's merge size and vision token ids bound (a partial, so
    data workers can pickle it)."""
    tokens = model_cfg.tokens
    return functools.partial(
        get_rope_index,
        spatial_merge_size=model_cfg.projector.spatial_merge_size,
        image_token_id=tokens.image_token_id,
        video_token_id=tokens.video_token_id,
        vision_start_token_id=tokens.vision_start_token_id,
    )


def get_rope_index(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: list[float] | None = None,
    *,
    spatial_merge_size: int,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
) -> torch.Tensor:
    """3D rotary position ids for ONE sample; positions start at 0.

    Args:
        input_ids: LongTensor[L] with every image expanded to ``grid_h*grid_w / merge**2`` pad
            tokens and every video frame (temporal patch) to as many video pads, each run preceded
            by vision_start.
        image_grid_thw: LongTensor[n_images, 3] in patches, in order of appearance.
        video_grid_thw: LongTensor[n_videos, 3]; video ``i`` gives ``grid_t`` runs of video tokens.
        second_per_grid_ts: accepted for the family interface; Qwen3-VL ignores it.

    Returns:
        LongTensor[3, L]: rows are (temporal, height, width) ids.

    Text tokens advance all three ids together by 1. A vision run (an image or one video frame)
    starting at position ``s`` gets ``temporal = s``, ``height = s + row``, ``width = s + col`` over
    its merged (grid_h/m, grid_w/m) grid; the text after it resumes at ``s + max(grid_h, grid_w)/m``.
    This equals transformers' ``Qwen3VLModel.get_rope_index``.

    Worked example, merge 2: ``[t <vs> V V <ve> <ts> <vs> V V <ve> t]``, one video of grid (2, 2, 4)
    (two frames, each merged 1x2, so 2 pad tokens ``V`` per frame; ``<ts>`` a timestamp token)::

        token     t  vs  V  V  ve  ts  vs  V  V  ve  t
        temporal  0  1   2  2  4   5   6   7  7  9   10
        height    0  1   2  2  4   5   6   7  7  9   10
        width     0  1   2  3  4   5   6   7  8  9   10

    Each frame starts where the text before it ends and advances the text by max(2, 4)/2 = 2.
    """
    _ = second_per_grid_ts
    if input_ids.dim() != 1:
        raise ValueError(f"get_rope_index takes one sample, input_ids of shape [L]; got {tuple(input_ids.shape)}")
    token_type = torch.zeros_like(input_ids)  # 0 text, 1 image, 2 video frame
    token_type[input_ids == image_token_id] = 1
    token_type[input_ids == video_token_id] = 2
    runs = _runs(token_type)
    grids = {1: _as_rows(image_grid_thw), 2: _frames(video_grid_thw)}
    _check_run_counts(runs, grids, input_ids, vision_start_token_id, spatial_merge_size)

    pieces: list[torch.Tensor] = []
    position = 0
    used = {1: 0, 2: 0}
    for kind, start, end in runs:
        if kind == 0:
            pieces.append(torch.arange(position, position + end - start).expand(3, -1))
            position += end - start
            continue
        _, grid_h, grid_w = grids[kind][used[kind]]
        used[kind] += 1
        merged_h, merged_w = grid_h // spatial_merge_size, grid_w // spatial_merge_size
        height = torch.arange(merged_h)[:, None].expand(merged_h, merged_w).reshape(-1)
        width = torch.arange(merged_w)[None, :].expand(merged_h, merged_w).reshape(-1)
        pieces.append(torch.stack([torch.zeros_like(height), height, width]) + position)
        position += max(grid_h, grid_w) // spatial_merge_size
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(pieces, dim=1)


def _runs(token_type: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of equal type as (type, start, end)."""
    if token_type.numel() == 0:
        return []
    change = torch.nonzero(token_type[1:] != token_type[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), token_type.numel()]
    types = token_type[bounds[:-1]].tolist()
    return list(zip(types, bounds[:-1], bounds[1:]))


def _as_rows(grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    return [] if grid_thw is None else [tuple(int(v) for v in row) for row in grid_thw.tolist()]


def _frames(video_grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """One (1, h, w) grid per temporal patch of every video, in order."""
    return [(1, h, w) for t, h, w in _as_rows(video_grid_thw) for _ in range(t)]


def _check_run_counts(runs, grids, input_ids: torch.Tensor, vision_start_token_id: int, merge: int) -> None:
    """Loud errors with counts: a mismatch here means the data pipeline expanded tokens wrongly."""
    for kind, name in ((1, "image"), (2, "video frame")):
        found = [(start, end) for k, start, end in runs if k == kind]
        if len(found) != len(grids[kind]):
            raise ValueError(f"{len(found)} {name} token runs in input_ids but the grids give "
                             f"{len(grids[kind])} {name}s (each video frame needs a run of its own)")
        for (start, end), (grid_t, grid_h, grid_w) in zip(found, grids[kind]):
            expected = grid_t * grid_h * grid_w // (merge * merge)
            if end - start != expected:
                raise ValueError(f"{name} run at {start} has {end - start} tokens; grid "
                                 f"{grid_t}x{grid_h}x{grid_w} needs {expected}")
            if start == 0 or int(input_ids[start - 1]) != vision_start_token_id:
                raise ValueError(f"{name} tokens at {start} are not preceded by vision_start")
