"""M-RoPE position ids of one Qwen2.5-VL sample (temporal, height, width)."""

from __future__ import annotations

import functools

import torch

from loongforge.config.schema import ModelConfig


def position_ids_for(model_cfg: ModelConfig):
    """``get_rope_index`` with this model's merge size, vision token ids and video time scale
    bound: the family's ``position_ids`` (a partial, so data workers can pickle it)."""
    return functools.partial(
        get_rope_index,
        spatial_merge_size=model_cfg.projector.spatial_merge_size,
        image_token_id=model_cfg.tokens.image_token_id,
        video_token_id=model_cfg.tokens.video_token_id,
        vision_start_token_id=model_cfg.tokens.vision_start_token_id,
        tokens_per_second=model_cfg.tokens_per_second,
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
    tokens_per_second: int,
) -> torch.Tensor:
    """3D rotary position ids for ONE sample; positions start at 0.

    Args:
        input_ids: LongTensor[L], with every image/video already expanded to its
            ``grid_t*grid_h*grid_w / merge**2`` pad tokens, each run preceded by vision_start.
        image_grid_thw: LongTensor[n_images, 3] in 14-px patches, in order of appearance.
        video_grid_thw: LongTensor[n_videos, 3].
        second_per_grid_ts: seconds of video per temporal patch, one per video (default 1.0).

    Returns:
        LongTensor[3, L]: rows are (temporal, height, width) ids.

    Text tokens advance all three ids together by 1. A vision run starting at position ``s`` gets
    ``temporal = s + floor(t * tokens_per_second * second_per_grid_t)`` (images: ``s``),
    ``height = s + row``, ``width = s + col`` over its merged (grid_h/2, grid_w/2) grid; the text
    after it resumes at ``s + max(grid_h, grid_w) / merge``. This is transformers 5.x
    (``Qwen2_5_VLModel.get_rope_index``); the original Qwen release resumed text after a *video*
    at ``1 + max`` of all its ids, temporal included, which differs when the temporal ids outrun
    the spatial ones.

    Worked example: ``[t t <vs> I I I I I I <ve> t]`` with one image of grid (1, 4, 6) (merged
    2x3, so 6 pad tokens ``I``), merge 2::

        token     t  t  vs  I  I  I  I  I  I  ve  t
        temporal  0  1  2   3  3  3  3  3  3  6   7
        height    0  1  2   3  3  3  4  4  4  6   7
        width     0  1  2   3  4  5  3  4  5  6   7

    ``<ve>`` is text, so it starts at 3 + max(4, 6) / 2 = 6. A video of grid (3, 2, 2) (one
    merged token per frame pair) at 2 tokens/s and 1 s per temporal patch gets temporal ids
    s, s+2, s+4.
    """
    if input_ids.dim() != 1:
        raise ValueError(f"get_rope_index takes one sample, input_ids of shape [L]; got {tuple(input_ids.shape)}")
    token_type = torch.zeros_like(input_ids)  # 0 text, 1 image, 2 video
    token_type[input_ids == image_token_id] = 1
    token_type[input_ids == video_token_id] = 2
    runs = _runs(token_type)
    grids = {1: _as_rows(image_grid_thw), 2: _as_rows(video_grid_thw)}
    _check_run_counts(runs, grids, input_ids, vision_start_token_id, spatial_merge_size)
    seconds = list(second_per_grid_ts) if second_per_grid_ts is not None else [1.0] * len(grids[2])

    pieces: list[torch.Tensor] = []
    position = 0
    used = {1: 0, 2: 0}
    for kind, start, end in runs:
        if kind == 0:
            pieces.append(torch.arange(position, position + end - start).expand(3, -1))
            position += end - start
            continue
        grid_t, grid_h, grid_w = grids[kind][used[kind]]
        time_step = tokens_per_second * seconds[used[kind]] if kind == 2 else 1
        used[kind] += 1
        merged_h, merged_w = grid_h // spatial_merge_size, grid_w // spatial_merge_size
        pieces.append(_vision_ids(position, grid_t, merged_h, merged_w, time_step))
        position += max(grid_h, grid_w) // spatial_merge_size
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(pieces, dim=1)


def _vision_ids(start: int, grid_t: int, merged_h: int, merged_w: int, time_step: float) -> torch.Tensor:
    """LongTensor[3, grid_t*merged_h*merged_w] for one image/video starting at ``start``."""
    temporal = (torch.arange(grid_t) * time_step).long() + start
    height = torch.arange(merged_h) + start
    width = torch.arange(merged_w) + start
    t_ids, h_ids, w_ids = torch.meshgrid(temporal, height, width, indexing="ij")
    return torch.stack([t_ids, h_ids, w_ids]).reshape(3, -1)


def _runs(token_type: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of equal type as (type, start, end)."""
    if token_type.numel() == 0:
        return []
    change = torch.nonzero(token_type[1:] != token_type[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), token_type.numel()]
    types = token_type[bounds[:-1]].tolist()
    return [(kind, start, end) for kind, start, end in zip(types, bounds[:-1], bounds[1:])]


def _as_rows(grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    return [] if grid_thw is None else [tuple(int(v) for v in row) for row in grid_thw.tolist()]


def _check_run_counts(runs, grids, input_ids: torch.Tensor, vision_start_token_id: int, merge: int) -> None:
    """Loud errors with counts: a mismatch here means the data pipeline expanded tokens wrongly."""
    for kind, name in ((1, "image"), (2, "video")):
        found = [(start, end) for k, start, end in runs if k == kind]
        if len(found) != len(grids[kind]):
            raise ValueError(f"{len(found)} {name} token runs in input_ids but {len(grids[kind])} {name} grids")
        for (start, end), (grid_t, grid_h, grid_w) in zip(found, grids[kind]):
            expected = grid_t * grid_h * grid_w // (merge * merge)
            if end - start != expected:
                raise ValueError(
                    f"{name} run at {start} has {end - start} tokens; grid {grid_t}x{grid_h}x{grid_w} needs {expected}"
                )
            if start == 0 or int(input_ids[start - 1]) != vision_start_token_id:
                raise ValueError(f"{name} tokens at {start} are not preceded by vision_start")
