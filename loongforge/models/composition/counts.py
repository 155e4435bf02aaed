"""A composition's counts and positions, each the run's tower's (``model.vision.arch``) with the shared
decoder's. Torch-free but for the position rule (a data-side function)."""

from __future__ import annotations

from collections.abc import Sequence

from loongforge.config.schema import ModelConfig
from loongforge.models import parts
from loongforge.models.flops import FlopOptions, StepFlops, vlm_training_flops
from loongforge.models.parts import composed_parameters
from loongforge.models.vlm import mrope_index
from loongforge.models.vlm.positions import sequential_positions


def count_parameters(model_cfg: ModelConfig) -> dict[str, int]:
    return composed_parameters(parts.tower(model_cfg.vision.arch).parameters, model_cfg)


def training_flops(model_cfg: ModelConfig, samples: Sequence, options: FlopOptions = FlopOptions()) -> StepFlops:
    return vlm_training_flops(parts.tower(model_cfg.vision.arch).flops, model_cfg, samples, options)


def positions_for(model_cfg: ModelConfig):
    """M-RoPE positions (Qwen2.5-VL's rule: a video one run) with ``mrope_section``, else 1-D."""
    if model_cfg.language.mrope_section:
        return mrope_index.position_ids_for(model_cfg, frames_as_images=False)
    return sequential_positions
