"""Parameter counts of Qwen2.5-VL's vision part by arithmetic on the config (no tensors)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_costs import linear_parameters as _linear


def vision_layer_parameters(model_cfg: ModelConfig) -> int:
    """One ViT block: 2 RMSNorms, fused qkv + proj (with biases), SwiGLU MLP (with biases)."""
    h, ffn = model_cfg.vision.hidden_size, model_cfg.vision.intermediate_size
    norms = 2 * h
    attention = _linear(h, 3 * h, bias=True) + _linear(h, h, bias=True)
    mlp = 2 * _linear(h, ffn, bias=True) + _linear(ffn, h, bias=True)
    return norms + attention + mlp


def encoder_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(the tower's, the merger's) parameter counts: ``parts.TowerPart.parameters``."""
    vis = model_cfg.vision
    patch_dim = vis.in_channels * vis.temporal_patch_size * vis.patch_size**2
    vision_model = patch_dim * vis.hidden_size + vis.depth * vision_layer_parameters(model_cfg)
    merged = vis.hidden_size * model_cfg.projector.spatial_merge_size**2
    projector = (
        vis.hidden_size  # ln_q
        + _linear(merged, merged, bias=True)
        + _linear(merged, model_cfg.projector.out_hidden_size, bias=True)
    )
    return vision_model, projector
