"""M-RoPE position ids of one sample (temporal, height, width): the rule of Qwen's VLMs, once.

Text tokens advance all three ids together by 1. A vision run (an image, a whole video, or one video
frame where frames are runs of their own) starting at position ``s`` gets ``temporal = s + time``,
``height = s + row`` and ``width = s + col`` over its merged (grid_h/m, grid_w/m) grid; the text after
it resumes at ``s + max(grid_h, grid_w) / m``. Qwen2.5-VL writes a video as one run whose temporal ids
step by ``tokens_per_second x seconds per temporal patch``; Qwen3-VL writes each frame as a run of its
own positioned like a one-frame image (``frames_as_images``: time reaches it through timestamp text).
Each family's ``rope_index.py`` binds its rule and documents a worked example.
"""

from __future__ import annotations

import functools

import torch

from loongforge.config.schema import ModelConfig


def position_ids_for(model_cfg: ModelConfig, *, frames_as_images: bool):
    """``get_rope_index`` with the model's merge size, vision token ids and video time scale bound:
    a family's ``position_ids`` (a partial, so data workers can pickle it)."""
    tokens = model_cfg.tokens
    return functools.partial(
        get_rope_index,
        spatial_merge_size=model_cfg.projector.spatial_merge_size,
        image_token_id=tokens.image_token_id,
        video_token_id=tokens.video_token_id,
        vision_start_token_id=tokens.vision_start_token_id,
        tokens_per_second=model_cfg.tokens_per_second,
        frames_as_images=frames_as_images,
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
    tokens_per_second: float = 1,
    frames_as_images: bool = False,
) -> torch.Tensor:
    """LongTensor[3, L]: the (temporal, height, width) ids of ONE sample, starting at 0.

    input_ids [L] with every image expanded to ``grid_h*grid_w / m**2`` pad tokens and every video to
    ``grid_t*grid_h*grid_w / m**2`` (one run), or, with ``frames_as_images``, every video frame
    (temporal patch) to its own run of ``grid_h*grid_w / m**2``; each run preceded by vision_start.
    image_grid_thw [n, 3], video_grid_thw [m, 3] in patches, in order of appearance;
    ``second_per_grid_ts``: seconds per temporal patch, one per video (default 1.0; unused with
    ``frames_as_images``)."""
    if input_ids.dim() != 1:
        raise ValueError(f"get_rope_index takes one sample, input_ids of shape [L]; got {tuple(input_ids.shape)}")
    token_type = torch.zeros_like(input_ids)  # 0 text, 1 image, 2 video (or video frame)
    token_type[input_ids == image_token_id] = 1
    token_type[input_ids == video_token_id] = 2
    runs = _runs(token_type)
    videos = _as_rows(video_grid_thw)
    grids = {1: _as_rows(image_grid_thw), 2: _frames(videos) if frames_as_images else videos}
    _check_run_counts(runs, grids, input_ids, vision_start_token_id, spatial_merge_size, frames_as_images)
    seconds = list(second_per_grid_ts) if second_per_grid_ts is not None else [1.0] * len(videos)

    pieces: list[torch.Tensor] = []
    position = 0
    used = {1: 0, 2: 0}
    for kind, start, end in runs:
        if kind == 0:
            pieces.append(torch.arange(position, position + end - start).expand(3, -1))
            position += end - start
            continue
        grid_t, grid_h, grid_w = grids[kind][used[kind]]
        time_step = tokens_per_second * seconds[used[kind]] if kind == 2 and not frames_as_images else 1
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


def _frames(videos: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """One (1, h, w) grid per temporal patch of every video, in order."""
    return [(1, h, w) for t, h, w in videos for _ in range(t)]


def _check_run_counts(runs, grids, input_ids: torch.Tensor, vision_start_token_id: int, merge: int,
                      frames_as_images: bool) -> None:
    """Loud errors with counts: a mismatch here means the data pipeline expanded tokens wrongly."""
    for kind, name in ((1, "image"), (2, "video frame" if frames_as_images else "video")):
        found = [(start, end) for k, start, end in runs if k == kind]
        if len(found) != len(grids[kind]):
            why = " (each video frame needs a run of its own)" if kind == 2 and frames_as_images else ""
            raise ValueError(f"{len(found)} {name} token runs in input_ids but the grids give "
                             f"{len(grids[kind])} {name}s{why}")
        for (start, end), (grid_t, grid_h, grid_w) in zip(found, grids[kind]):
            expected = grid_t * grid_h * grid_w // (merge * merge)
            if end - start != expected:
                raise ValueError(f"{name} run at {start} has {end - start} tokens; grid "
                                 f"{grid_t}x{grid_h}x{grid_w} needs {expected}")
            if start == 0 or int(input_ids[start - 1]) != vision_start_token_id:
                raise ValueError(f"{name} tokens at {start} are not preceded by vision_start")
