"""Weight map between transformers' Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE / Qwen3-Next / Llama / DeepSeek checkpoints
and ``TextModel``: the decoder's rows alone (``models.decoder.hf_mapping``); Qwen (1.0)'s own key layout: ``qwen1``.
HF 5's nested key style and its fused expert tensors are read too. Qwen3-Next's Gated DeltaNet keeps its input
projection in two tensors grouped by key head (``in_proj_qkvz``, ``in_proj_ba``; Qwen3.5's keeps four). The Hub's
Qwen3-Next checkpoints also hold a multi-token-prediction head (``mtp.*``) that transformers' class has no module
for: it is noted as not read (``ModelFamily.hf_unread``)."""

from __future__ import annotations

from typing import Any, Mapping

from loongforge.config.schema import LanguageConfig, ModelConfig
from loongforge.models.decoder.hf_mapping import hub_experts, language_hf_shapes, language_rules
from loongforge.models.decoder.text_config import architecture
from loongforge.models.hf.rules import Rule, rename_prefixes
from loongforge.models.llm.minimax_m2 import MINIMAX_M2_ARCHITECTURE, minimax_m2_hub_style, minimax_m2_rules
from loongforge.models.llm.qwen1 import (
    QWEN1_ARCHITECTURE,
    qwen1_rules,
)


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    lang = model_cfg.language
    if lang.architecture == MINIMAX_M2_ARCHITECTURE:
        return minimax_m2_rules(lang)
    if lang.architecture == QWEN1_ARCHITECTURE:
        return qwen1_rules(lang)
    return language_rules(lang, fused_delta_projections=fused_delta_projections(lang))


# The architectures whose Gated DeltaNet input projection is two tensors grouped by key head.
_FUSED_DELTA_PROJECTIONS = ("Qwen3NextForCausalLM",)


def fused_delta_projections(lang: LanguageConfig) -> bool:
    return architecture(lang) in _FUSED_DELTA_PROJECTIONS


def decoder_hf_shapes(lang: LanguageConfig) -> dict[str, tuple[int, ...]]:
    """The decoder's Hub tensor shapes (``language_hf_shapes``) in the architecture's key layout."""
    return language_hf_shapes(lang, fused_delta_projections=fused_delta_projections(lang))


def to_hub_style(hf_state: Mapping[str, Any]) -> dict[str, Any]:
    """``model.language_model.*`` (a causal LM saved from inside a VLM wrapper) -> ``model.*``;
    fused expert tensors (transformers 5's in-memory Qwen3-MoE) -> one per expert; transformers 5's in-memory
    MiniMax-M2 -> its Hub names (``minimax_m2``); attention sinks (MiMo-V2-Flash's in-memory ``self_attn.sinks``)
    -> the Hub's ``self_attn.attention_sink_bias``."""
    state = hub_experts(minimax_m2_hub_style(rename_prefixes(hf_state, (("model.language_model.", "model."),))))
    return {key[: -len(_SINKS)] + _HUB_SINKS if key.endswith(_SINKS) else key: value for key, value in state.items()}


_SINKS, _HUB_SINKS = ".self_attn.sinks", ".self_attn.attention_sink_bias"
