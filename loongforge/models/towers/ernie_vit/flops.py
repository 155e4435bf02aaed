"""The FLOPs of ERNIE-4.5-VL's ViT and resampler per training micro-batch (convention in ``models.flops``).

What runs (``vision.py``): the patch embedding (a linear over ``C*p*p`` pixels) on every patch; ``depth``
blocks of QKV, output projection and a plain MLP, attending within each frame; then the resampler on every
merge unit (``m^2 h -> m^2 h -> m^2 h``), on every token (``2 m^2 h -> m^2 h -> m^2 h``, then ``m^2 h ->
out``); an image's tokens are its merge units, a video's half its frames'.
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
    """(vision, resampler) FLOPs of the micro-batch's images and videos ``grids``: ``flops.EncoderFlops``."""
    vis, merge, out = model_cfg.vision, model_cfg.projector.spatial_merge_size, model_cfg.projector.out_hidden_size
    vision = plain_frame_tower_flops(vis, grids, options)
    patches = sum(t * h * w for t, h, w in grids)
    width = vis.hidden_size * merge**2
    units = patches // merge**2
    tokens = sum(h * w // merge**2 * (1 if t == 1 else t // 2) for t, h, w in grids)
    resampler = (2 * linear_flops(units, width, width) + linear_flops(tokens, 2 * width, width)
                 + linear_flops(tokens, width, width) + linear_flops(tokens, width, out))
    return vision, projector_passes(options) * resampler
