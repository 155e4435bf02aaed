"""The FLOPs of Qwen2.5-VL's vision part per training micro-batch (convention in ``models.flops``).

What runs (``vision.py``): the patch embedding (a linear over ``C*T*p*p`` pixels), ``depth`` blocks
of QKV, output projection and a SwiGLU MLP, where attention is bidirectional within each window
(``model.vision.window.size`` pixels square, tiled from the top-left of each frame in merge units, edge windows
smaller: ``window_partition``) except in the ``fullatt_block_indexes`` blocks, which attend within
whole frames; then the merger MLP per merged token, and the shared decoder and LM head.
"""

from __future__ import annotations

from typing import Sequence

from loongforge.config.schema import ModelConfig
from loongforge.models.flops import (
    FlopOptions,
    Grid,
    attention_flops,
    frame_attention_flops,
    patch_merger_flops,
    patch_tower_flops,
    vision_block_linear_flops,
    vision_block_saved_values,
)


def window_sizes(h: int, w: int, merge: int, window_units: int) -> list[int]:
    """Patches per attention window of one ``h x w``-patch frame: merge units tiled from the
    top-left in ``window_units``-square windows, edge windows smaller (``vision.window_partition``)."""
    units_h, units_w = h // merge, w // merge

    def spans(n: int) -> list[int]:
        return [min(window_units, n - start) for start in range(0, n, window_units)]

    return [rows * cols * merge * merge for rows in spans(units_h) for cols in spans(units_w)]


def window_lengths(grids: Sequence[Grid], merge: int, window_units: int) -> list[int]:
    """The window segments of every frame of every medium."""
    return [size for t, h, w in grids for _ in range(t) for size in window_sizes(h, w, merge, window_units)]


def blocks_forward_flops(model_cfg: ModelConfig, grids: Sequence[Grid]) -> int:
    """All vision blocks' forward: matmuls per patch, attention per window or per frame."""
    vis, merge = model_cfg.vision, model_cfg.projector.spatial_merge_size
    patches = sum(t * h * w for t, h, w in grids)
    full_blocks = vis.window.full_attention_blocks(vis.depth)
    window_units = vis.window.size // vis.patch_size // merge
    # Vision heads are hidden / num_heads wide: q_width is the tower's width.
    windowed = attention_flops(window_lengths(grids, merge, window_units), vis.hidden_size)
    full = frame_attention_flops(grids, vis.hidden_size)
    linears = vision_block_linear_flops(patches, vis.hidden_size, vis.intermediate_size, gated=True)
    return vis.depth * linears + full_blocks * full + (vis.depth - full_blocks) * windowed


def vision_flops(model_cfg: ModelConfig, grids: Sequence[Grid], options: FlopOptions) -> int:
    vis = model_cfg.vision
    return patch_tower_flops(grids, options, in_channels=vis.in_channels, temporal_patch_size=vis.temporal_patch_size,
                             patch_size=vis.patch_size, width=vis.hidden_size,
                             blocks_forward=blocks_forward_flops(model_cfg, grids))


def projector_flops(model_cfg: ModelConfig, grids: Sequence[Grid], options: FlopOptions) -> int:
    return patch_merger_flops(grids, options, merge=model_cfg.projector.spatial_merge_size,
                              width=model_cfg.vision.hidden_size, out_width=model_cfg.projector.out_hidden_size)


def saved_values(model_cfg: ModelConfig, tp: int) -> float:
    """Values a block saves per patch (``TowerPart.saved_values``): a SwiGLU MLP."""
    vis = model_cfg.vision
    return vision_block_saved_values(vis.hidden_size, vis.intermediate_size, tp, gated=True)


def encoder_flops(model_cfg: ModelConfig, grids: Sequence[Grid], options: FlopOptions) -> tuple[int, int]:
    """(vision, projector) FLOPs of the micro-batch's media ``grids``: ``flops.EncoderFlops``."""
    return vision_flops(model_cfg, grids, options), projector_flops(model_cfg, grids, options)
