"""Parameter counts of Qwen3-VL's vision part by arithmetic on the config (no tensors)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_costs import linear_parameters as _linear


def encoder_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(the tower's, the mergers' (the merger and DeepStack's)) parameter counts:
    ``parts.TowerPart.parameters``."""
    vis, proj = model_cfg.vision, model_cfg.projector
    h, ffn = vis.hidden_size, vis.intermediate_size
    patch_dim = vis.in_channels * vis.temporal_patch_size * vis.patch_size**2
    block = (4 * h + _linear(h, 3 * h, bias=True) + _linear(h, h, bias=True)
             + _linear(h, ffn, bias=True) + _linear(ffn, h, bias=True))
    vision_model = _linear(patch_dim, h, bias=True) + vis.num_position_embeddings * h + vis.depth * block
    merged = h * proj.spatial_merge_size**2

    def merger(norm_width: int) -> int:
        return 2 * norm_width + _linear(merged, merged, bias=True) + _linear(merged, proj.out_hidden_size, bias=True)

    return vision_model, merger(h) + len(vis.deepstack_layers) * merger(merged)
