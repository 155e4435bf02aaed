"""Parameter counts of SigLIP and the MLP projector by arithmetic on the config (no tensors).

SigLIP's post-layernorm, which is never run, is built (frozen, carried for the checkpoint) and counted, as
transformers counts it."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_costs import linear_parameters as _linear


def encoder_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(SigLIP's, the projector's) parameter counts as built: ``parts.TowerPart.parameters``."""
    vis = model_cfg.vision
    h, ffn = vis.hidden_size, vis.intermediate_size
    side = vis.image_size // vis.patch_size
    embeddings = _linear(vis.in_channels * vis.patch_size**2, h, bias=True) + side * side * h + 2 * h  # + post-norm
    block = (4 * h + _linear(h, 3 * h, bias=True) + _linear(h, h, bias=True)
             + _linear(h, ffn, bias=True) + _linear(ffn, h, bias=True))
    out = model_cfg.projector.out_hidden_size
    return embeddings + vis.depth * block, _linear(h, out, bias=True) + _linear(out, out, bias=True)
