"""The made-up tower's FLOPs per micro-batch and parameter counts, torch-free. Its blocks and projector
are a SigLIP-like stack (``encoder.py``), so SigLIP's arithmetic counts them; the tower has no newline
vector, which SigLIP's count includes."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.towers.siglip import flops, params

# (model_cfg, grids, options) -> (vision, projector) FLOPs: the patch embedding, ``depth`` plain blocks
# attending within each image, then the two projector linears on every patch.
encoder_flops = flops.encoder_flops


def encoder_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(tower, projector) parameters as built."""
    tower, projector_and_newline = params.encoder_parameters(model_cfg)
    return tower, projector_and_newline - model_cfg.projector.out_hidden_size
