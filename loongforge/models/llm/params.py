"""Parameter counts of a text-only LLM by arithmetic on the config."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.params import expert_parameters, language_parameters


def count_parameters(model_cfg: ModelConfig) -> dict[str, int]:
    """{"vision_model", "projector", "language_model", "total", "active", "routed_experts"}: no towers besides the
    decoder; ``active`` is what one token runs through (the router's top-k experts of each MoE
    layer; all parameters of a dense model)."""
    language_model = language_parameters(model_cfg.language)
    lang = model_cfg.language
    return {"vision_model": 0, "projector": 0, "language_model": language_model, "total": language_model,
            "active": language_parameters(lang, active=True),
            "routed_experts": lang.num_layers * expert_parameters(lang)}
