"""The made-up tower's FLOPs per micro-batch, parameter counts, saved values and settings checks, torch-free.
Its blocks and projector are a SigLIP-like stack (``encoder.py``), so SigLIP's arithmetic counts them; its
shape rows (two vectors of the language model's width) are its own."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.flops import plain_block_saved_values
from loongforge.models.towers.siglip import flops, params

# (model_cfg, grids, options) -> (vision, projector) FLOPs: the patch embedding, ``depth`` plain blocks
# attending within each image, then the two projector linears on every patch.
encoder_flops = flops.encoder_flops
# (model_cfg, vision TP) -> values a block saves per patch: SigLIP-like blocks with a plain MLP.
saved_values = plain_block_saved_values


def problems(model_cfg: ModelConfig) -> list[str]:
    """Settings it cannot be built with (``TowerPart.config_problems``), checked before a run starts."""
    merge = model_cfg.projector.spatial_merge_size
    if merge != 1:
        return [f"model.projector.spatial_merge_size={merge}: the made-up tower maps every patch to a token; set 1"]
    return []


def encoder_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(tower, projector and orientation rows) parameters as built."""
    tower, projector = params.encoder_parameters(model_cfg)
    return tower, projector + 2 * model_cfg.projector.out_hidden_size
