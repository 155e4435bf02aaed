"""Parameter counts of LLaVA-OneVision's vision part by arithmetic on the config (no tensors).

SigLIP's checkpoint also holds a post-layernorm (and, when ``vision_use_head``, a pooling head) that
LLaVA-OneVision never runs (it reads the last layer's output): they are not built here, and
``hf_checkpoint_extra`` counts them for a comparison with a checkpoint."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.params import linear_parameters as _linear


def encoder_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(SigLIP's, the projector's and the newline's) parameter counts as built: ``parts.TowerPart.parameters``."""
    vis = model_cfg.vision
    h, ffn = vis.hidden_size, vis.intermediate_size
    side = vis.image_size // vis.patch_size
    embeddings = _linear(vis.in_channels * vis.patch_size**2, h, bias=True) + side * side * h
    block = (4 * h + _linear(h, 3 * h, bias=True) + _linear(h, h, bias=True)
             + _linear(h, ffn, bias=True) + _linear(ffn, h, bias=True))
    out = model_cfg.projector.out_hidden_size
    # The projector's two linears and the packing's newline vector.
    return embeddings + vis.depth * block, _linear(h, out, bias=True) + _linear(out, out, bias=True) + out


def hf_checkpoint_extra(model_cfg: ModelConfig) -> int:
    """Parameters of SigLIP's post-layernorm, which a checkpoint holds and the model does not run."""
    return 2 * model_cfg.vision.hidden_size
