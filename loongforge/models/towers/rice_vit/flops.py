"""The FLOPs of RICE-ViT and its patch merger per training micro-batch (convention in ``models.flops``).

What runs (``vision.py``): the patch embedding (a linear over ``C*p*p`` pixels) on every patch; ``depth``
blocks of QKV, output projection and a plain MLP over each frame's patches and its class token, attending
within the frame; then the merger on every merged token (``m^2 w -> m^2 w -> out``).
"""

from __future__ import annotations

from typing import Sequence

from loongforge.config.schema import ModelConfig
from loongforge.models.flops import (
    FlopOptions,
    Grid,
    attention_flops,
    frame_lengths,
    patch_merger_flops,
    patch_tower_flops,
    vision_block_linear_flops,
)


def blocks_forward_flops(model_cfg: ModelConfig, grids: Sequence[Grid]) -> int:
    """All blocks' forward: each frame is its patches and its class token."""
    vis = model_cfg.vision
    frames = [length + 1 for length in frame_lengths(grids)]
    linears = vision_block_linear_flops(sum(frames), vis.hidden_size, vis.intermediate_size, gated=False)
    return vis.depth * (linears + attention_flops(frames, vis.hidden_size))


def encoder_flops(model_cfg: ModelConfig, grids: Sequence[Grid], options: FlopOptions) -> tuple[int, int]:
    """(vision, projector) FLOPs of the micro-batch's media ``grids``: ``flops.EncoderFlops``."""
    vis, proj = model_cfg.vision, model_cfg.projector
    vision = patch_tower_flops(grids, options, in_channels=vis.in_channels, temporal_patch_size=1,
                               patch_size=vis.patch_size, width=vis.hidden_size,
                               blocks_forward=blocks_forward_flops(model_cfg, grids))
    merger = patch_merger_flops(grids, options, merge=proj.spatial_merge_size, width=vis.hidden_size,
                                out_width=proj.out_hidden_size)
    return vision, merger
