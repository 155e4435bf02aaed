"""Parameter counts of InternVL's vision part by arithmetic on the config (no tensors)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.params import linear_parameters as _linear


def encoder_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(InternViT's, the pixel-shuffle projector's) parameter counts: ``parts.TowerPart.parameters``."""
    vis = model_cfg.vision
    h, ffn = vis.hidden_size, vis.intermediate_size
    side = vis.image_size // vis.patch_size
    embeddings = _linear(vis.in_channels * vis.patch_size**2, h, bias=True) + h + (1 + side * side) * h
    # two LayerNorms (weight and bias), qkv and proj with biases, the MLP with biases, two layer scales
    block = (4 * h + _linear(h, 3 * h, bias=True) + _linear(h, h, bias=True)
             + _linear(h, ffn, bias=True) + _linear(ffn, h, bias=True))
    block += 2 * h
    merged, out = 4 * h, model_cfg.projector.out_hidden_size
    projector = 2 * merged + _linear(merged, out, bias=True) + _linear(out, out, bias=True)
    return embeddings + vis.depth * block, projector
