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
    linear_flops,
    plain_frame_tower_flops,
    projector_passes,
)


def encoder_flops(model_cfg: ModelConfig, grids: Sequence[Grid], options: FlopOptions) -> tuple[int, int]:
    """(vision, projector) FLOPs of the micro-batch's images ``grids``: ``flops.EncoderFlops``."""
    vis, out = model_cfg.vision, model_cfg.projector.out_hidden_size
    vision = plain_frame_tower_flops(vis, grids, options)
    patches = sum(t * h * w for t, h, w in grids)
    projector = linear_flops(patches, vis.hidden_size, out) + linear_flops(patches, out, out)
    return vision, projector_passes(options) * projector
