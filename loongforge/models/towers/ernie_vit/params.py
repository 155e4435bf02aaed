"""Parameter counts of ERNIE-4.5-VL's ViT and resampler by arithmetic on the config (no tensors)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_costs import linear_parameters as _linear


def encoder_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(the ViT's, the resampler's) parameter counts: ``parts.TowerPart.parameters``."""
    vis = model_cfg.vision
    h, ffn = vis.hidden_size, vis.intermediate_size
    block = 4 * h + _linear(h, 3 * h, bias=True) + _linear(h, h, bias=True) + _linear(h, ffn, bias=True) \
        + _linear(ffn, h, bias=True)
    vision_model = vis.in_channels * vis.patch_size**2 * h + vis.depth * block + 2 * h  # + the final LayerNorm
    width, out = h * model_cfg.projector.spatial_merge_size**2, model_cfg.projector.out_hidden_size
    spatial = 2 * _linear(width, width, bias=True) + 2 * width
    temporal = _linear(2 * width, width, bias=True) + _linear(width, width, bias=True) + 2 * width
    return vision_model, spatial + temporal + _linear(width, out, bias=True) + out
