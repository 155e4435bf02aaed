"""The FLOPs of SigLIP and the MLP projector per training micro-batch (convention in ``models.flops``).

What runs (``vision.py``): the patch embedding (a linear over ``C*p*p`` pixels) on every patch of every
square image (LLaVA-OneVision's: the base image and each anyres crop); ``depth`` blocks of QKV, output projection and a plain
MLP over each image's patches, attending within the image; then the projector on every patch:
``w -> out -> out``.
"""

from __future__ import annotations

from typing import Sequence

from loongforge.config.schema import ModelConfig
from loongforge.models.flops import (
    FlopOptions,
    Grid,
    attention_flops,
    frame_lengths,
    linear_flops,
    patch_embedding_flops,
    projector_passes,
    vision_block_linear_flops,
    vision_block_passes,
    vision_block_saved_values,
)


def saved_values(model_cfg: ModelConfig, tp: int) -> float:
    """Values a block saves per patch (``TowerPart.saved_values``): a plain tanh-GELU MLP."""
    vis = model_cfg.vision
    return vision_block_saved_values(vis.hidden_size, vis.intermediate_size, tp, gated=False)


def encoder_flops(model_cfg: ModelConfig, grids: Sequence[Grid], options: FlopOptions) -> tuple[int, int]:
    """(vision, projector) FLOPs of the micro-batch's images ``grids``: ``flops.EncoderFlops``."""
    vis, out = model_cfg.vision, model_cfg.projector.out_hidden_size
    patches = sum(t * h * w for t, h, w in grids)
    embedding = patch_embedding_flops(grids, in_channels=vis.in_channels, temporal_patch_size=1,
                                      patch_size=vis.patch_size, width=vis.hidden_size, options=options)
    blocks = vis.depth * (vision_block_linear_flops(patches, vis.hidden_size, vis.intermediate_size, gated=False)
                          + attention_flops(frame_lengths(grids), vis.hidden_size))
    projector = linear_flops(patches, vis.hidden_size, out) + linear_flops(patches, out, out)
    return embedding + vision_block_passes(options) * blocks, projector_passes(options) * projector
