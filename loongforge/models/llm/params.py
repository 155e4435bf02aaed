"""Parameter counts of a text-only LLM by arithmetic on the config."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.params import model_parameters


def count_parameters(model_cfg: ModelConfig) -> dict[str, int]:
    """``decoder.params.model_parameters`` without an encoder."""
    return model_parameters(model_cfg)
