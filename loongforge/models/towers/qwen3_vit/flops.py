"""The FLOPs of Qwen3-VL's vision part per training micro-batch (convention in ``models.flops``).

What runs (``vision.py``, ``encoder.py``): the patch embedding (a linear over ``C*T*p*p`` pixels);
the learned position embeddings resampled to each grid (four table rows per patch blended with
bilinear weights: a gather and a weighted sum, no matmul, not counted); ``depth`` blocks of QKV,
output projection and a plain (ungated) MLP, attending within each frame (no windows); the merger
on the last block's output and one DeepStack merger on each ``deepstack_visual_indexes`` block's
output, the same MLP per merged token (their features are added to the decoder's hidden states:
not counted); then the shared decoder (with or without experts) and the LM head.
"""

from __future__ import annotations

from typing import Sequence

from loongforge.config.schema import ModelConfig
from loongforge.models.flops import (
    FlopOptions,
    Grid,
    frame_attention_flops,
    patch_merger_flops,
    patch_tower_flops,
    vision_block_linear_flops,
    vision_block_saved_values,
)
from loongforge.models.towers.qwen3_vit.vision_facts import Qwen3VisionConfig


def blocks_forward_flops(vision: Qwen3VisionConfig, grids: Sequence[Grid]) -> int:
    """All vision blocks' forward: matmuls per patch, attention per frame (heads are hidden /
    num_heads wide: q_width is the tower's width)."""
    patches = sum(t * h * w for t, h, w in grids)
    linears = vision_block_linear_flops(patches, vision.hidden_size, vision.intermediate_size, gated=False)
    return vision.depth * (linears + frame_attention_flops(grids, vision.hidden_size))


def vision_flops(vision: Qwen3VisionConfig, grids: Sequence[Grid], options: FlopOptions) -> int:
    return patch_tower_flops(grids, options, in_channels=vision.in_channels,
                             temporal_patch_size=vision.temporal_patch_size, patch_size=vision.patch_size,
                             width=vision.hidden_size, blocks_forward=blocks_forward_flops(vision, grids))


def projector_flops(vision: Qwen3VisionConfig, grids: Sequence[Grid], options: FlopOptions) -> int:
    """The merger and the DeepStack mergers (``training.freeze_projector`` freezes them all)."""
    merger = patch_merger_flops(grids, options, merge=vision.spatial_merge_size, width=vision.hidden_size,
                                out_width=vision.out_hidden_size)
    return (1 + vision.num_deepstack_layers) * merger


def saved_values(model_cfg: ModelConfig, tp: int) -> float:
    """Values a block saves per patch (``TowerPart.saved_values``): a plain GELU MLP."""
    vision = Qwen3VisionConfig.from_model_cfg(model_cfg)
    return vision_block_saved_values(vision.hidden_size, vision.intermediate_size, tp, gated=False)


def encoder_flops(model_cfg: ModelConfig, grids: Sequence[Grid], options: FlopOptions) -> tuple[int, int]:
    """(vision, projector) FLOPs of the micro-batch's media ``grids``: ``flops.EncoderFlops``."""
    vision = Qwen3VisionConfig.from_model_cfg(model_cfg)
    return vision_flops(vision, grids, options), projector_flops(vision, grids, options)
