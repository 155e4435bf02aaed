"""Parameter counts of RICE-ViT and its patch merger by arithmetic on the config (no tensors)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_costs import linear_parameters as _linear


def encoder_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(the tower's, the merger's) parameter counts: ``parts.TowerPart.parameters``."""
    vis, proj = model_cfg.vision, model_cfg.projector
    h, ffn = vis.hidden_size, vis.intermediate_size
    head_dim = h // vis.num_heads
    block = (4 * h + _linear(h, 3 * h, bias=True) + _linear(h, h, bias=True)
             + _linear(h, ffn, bias=True) + _linear(ffn, h, bias=True))
    # patch embedding (no bias), class token, its rotary angles (half a head), pre-layernorm, blocks
    tower = _linear(vis.in_channels * vis.patch_size**2, h, bias=False) + h + head_dim // 2 + 2 * h + vis.depth * block
    merged = h * proj.spatial_merge_size**2
    merger = 2 * h + _linear(merged, merged, bias=True) + _linear(merged, proj.out_hidden_size, bias=True)
    return tower, merger
