"""Qwen3.5's HF ``config.json`` both ways, and the HF tensor shapes a config implies.

transformers nests the hybrid decoder under ``text_config``: ``layer_types`` (each layer
``linear_attention`` or ``full_attention``; older files give ``full_attention_interval`` instead, every
n-th layer full), Gated DeltaNet's ``linear_*`` sizes, ``head_dim`` and the rotary settings under
``rope_parameters`` (``rope_theta``, ``partial_rotary_factor``, the interleaved ``mrope_section``); its
full-attention layers always gate their output and its RMSNorms are zero-centred (neither is a config
key). The vision tower under ``vision_config`` is Qwen3-VL's without DeepStack.

Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``, model_type ``qwen3_5_moe``) routes every layer's MLP
to experts (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``; the top-k always
renormalised) beside a gated shared expert (``shared_expert_intermediate_size``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from loongforge.config.errors import InputError
from loongforge.config.schema import LanguageConfig, ModelConfig
from loongforge.models.decoder.hf_config import (
    experts_from_hf,
    hybrid_layer_types,
    hybrid_layers_to_hf,
    linear_attention_from_hf,
)
from loongforge.models.decoder.hf_mapping import language_hf_shapes
from loongforge.models.qwen3_5.hf_mapping import to_hub_style
from loongforge.models.qwen_vl import hf_config as nested
from loongforge.models.towers.qwen3_vit.hf_config import tower_from_hf, tower_to_hf
from loongforge.models.towers.qwen3_vit.hf_mapping import tower_hf_shapes

NAME = "qwen3_5"
_NAMES = nested.HfNames(class_prefix="Qwen3_5", model_type="qwen3_5")
HF_ARCHITECTURES = _NAMES.architectures  # Qwen3_5[Moe]ForConditionalGeneration, Qwen3_5[Moe]Model
HF_MODEL_TYPES = (_NAMES.model_types(False)[0], _NAMES.model_types(True)[0])  # qwen3_5, qwen3_5_moe
# transformers' defaults when a config names none (Qwen3_5TextConfig, Qwen3_5TextRotaryEmbedding).
_DEFAULT_MROPE_SECTION = [11, 11, 10]
_DEFAULT_PARTIAL_ROTARY = 0.25


def _rope(text: Mapping[str, Any]) -> tuple[float, list[int], float]:
    params = nested.rope_parameters(text)
    theta = params.get("rope_theta", text.get("rope_theta", 10_000_000.0))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY))
    return float(theta), list(params.get("mrope_section") or _DEFAULT_MROPE_SECTION), float(partial)


def _experts(text: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Every layer's routed experts (transformers' router always renormalises the top-k) and its gated
    shared expert."""
    experts = experts_from_hf(text, where, model="Qwen3.5-MoE", key_prefix="text_config.")
    return {"moe": dataclasses.replace(experts["moe"], norm_topk_prob=True,
                                       shared_expert_ffn_hidden_size=text["shared_expert_intermediate_size"])}


def _experts_to_hf(lang: LanguageConfig) -> dict[str, Any]:
    return dict(num_experts=lang.moe.num_experts, moe_intermediate_size=lang.moe.ffn_hidden_size,
                num_experts_per_tok=lang.moe.router_topk, router_aux_loss_coef=lang.moe.aux_loss_coeff,
                shared_expert_intermediate_size=lang.moe.shared_expert_ffn_hidden_size)


def _language(text: Mapping[str, Any], tied: bool, experts: dict[str, Any]) -> LanguageConfig:
    if experts and "intermediate_size" not in text:
        # Every layer is sparse, and the Hub's Qwen3.6-35B-A3B config.json names no dense MLP width: the unused
        # ffn_hidden_size reads as the experts' width.
        text = {**text, "intermediate_size": experts["moe"].ffn_hidden_size}
    theta, section, partial = _rope(text)
    layer_types = hybrid_layer_types(text)
    linear = linear_attention_from_hf(text) if "linear_attention" in layer_types else None
    return nested.language_from_hf(
        text, tied=tied, rope=(theta, section), default_head_dim=256, layer_types=layer_types,
        linear_attention=linear, attention_output_gate=True, partial_rotary_factor=partial,
        zero_centered_norms=True, **experts)


def model_config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    """``ModelConfig`` from a Qwen3.5 ``config.json``."""
    if (cfg.get("text_config") or {}).get("attention_bias"):
        raise InputError(f"{where}: text_config.attention_bias=true: Qwen3.5's attention has no biases")
    return nested.model_config_from_hf(
        cfg, where, family=NAME, model="Qwen3.5", tower=tower_from_hf, language=_language,
        experts=lambda text: _experts(text, where) if _NAMES.is_moe(cfg) else {})


def hf_config_from_model(model_cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A transformers-style ``config.json``, written when the source carries none."""
    lang = model_cfg.language
    moe = lang.moe is not None
    if moe and (not lang.moe.norm_topk_prob or lang.moe.shared_expert_ffn_hidden_size is None):
        raise ValueError("a Qwen3.5-MoE config.json renormalises the top-k (norm_topk_prob true) and has a shared "
                         "expert (model.language.moe.shared_expert_ffn_hidden_size)")
    _, text_type, vision_type = _NAMES.model_types(moe)
    text = {
        **nested.text_config_to_hf(lang, text_type, dtype),
        **hybrid_layers_to_hf(lang),
        "rope_parameters": {"rope_type": "default", "rope_theta": lang.rope_theta,
                            "partial_rotary_factor": lang.partial_rotary_factor,
                            "mrope_section": list(lang.mrope_section), "mrope_interleaved": True},
        **(_experts_to_hf(lang) if moe else {}),
    }
    return nested.nested_hf_config(_NAMES, model_cfg, dtype, text=text,
                                   vision=tower_to_hf(model_cfg, vision_type, deepstack=False))


def expected_hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hub-style HF tensor name (Qwen3.5's nested names) -> shape implied by ``model_cfg``."""
    shapes = tower_hf_shapes(model_cfg)
    # The Hub's files hold one tensor per expert (transformers fuses them as it loads).
    shapes.update(language_hf_shapes(model_cfg.language, fused_experts=False))
    return to_hub_style(shapes)
