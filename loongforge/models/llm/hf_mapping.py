"""Weight map between transformers' Qwen2 / Qwen3 / Qwen3-MoE / Llama checkpoints and ``TextModel``:
the decoder's rows alone (``models.decoder.hf_mapping``). HF 5's nested key style and its fused
expert tensors are read too."""

from __future__ import annotations

from typing import Any, Mapping

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import hub_experts, language_rules
from loongforge.models.hf.rules import Rule, rename_prefixes


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    return language_rules(model_cfg.language)


def to_hub_style(hf_state: Mapping[str, Any]) -> dict[str, Any]:
    """``model.language_model.*`` (a causal LM saved from inside a VLM wrapper) -> ``model.*``;
    fused expert tensors (transformers 5's in-memory Qwen3-MoE) -> one per expert."""
    return hub_experts(rename_prefixes(hf_state, (("model.language_model.", "model."),)))
