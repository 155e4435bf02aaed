"""A text backbone's HF ``config.json`` fields, both ways: Qwen1.5 / Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE,
Qwen1.5-MoE / Qwen2-MoE, Qwen3-Next, Llama 2 / 3.x, DeepSeek-V2 / V3 / V3.2 and GLM-5 (``deepseek_config``) and MiMo-V2-Flash
(``mimo_config``), as a text-only LLM's whole config.json (``llm``) or a VLM's ``text_config`` (InternVL3.5's Qwen3,
LLaVA-OneVision's Qwen2).

The architectures differ, as far as the weights go, in four switches of ``LanguageConfig``:
q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), routed experts (Qwen3-MoE: Qwen3's
attention, ``moe`` set; Qwen2-MoE: Qwen2's attention, ``moe`` set with a gated shared expert) and hybrid
layers (Qwen3-Next: Qwen3.5's layer kinds, ``layer_types`` naming Gated DeltaNet and gated full-attention
layers, zero-centred norms and partial RoPE, with Qwen2-MoE's gated shared expert); Llama has none (and may
scale its RoPE frequencies).
``architecture`` reads the switches back, so a config written for one is read as it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from loongforge.config.errors import InputError
from loongforge.config.schema import LanguageConfig, ModelConfig
from loongforge.models.decoder.deepseek_config import (
    DEEPSEEK_ARCHITECTURES,
    SPARSE_ARCHITECTURES,
    deepseek_architecture,
    deepseek_from_hf,
    deepseek_to_hf,
)
from loongforge.models.decoder.mimo_config import (
    MIMO_ARCHITECTURE,
    MIMO_MODEL_TYPE,
    mimo_from_hf,
    mimo_problems,
    mimo_to_hf,
)
from loongforge.models.decoder.hf_config import (
    experts_from_hf,
    experts_to_hf,
    hybrid_layer_types,
    hybrid_layers_to_hf,
    linear_attention_from_hf,
)

# architecture name -> (model_type, add_qkv_bias, qk_norm, experts, hybrid layers)
_ARCHITECTURES = {
    "Qwen2ForCausalLM": ("qwen2", True, False, False, False),
    "Qwen3ForCausalLM": ("qwen3", False, True, False, False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True, True, False),
    "Qwen2MoeForCausalLM": ("qwen2_moe", True, False, True, False),
    "Qwen3NextForCausalLM": ("qwen3_next", False, True, True, True),
    "LlamaForCausalLM": ("llama", False, False, False, False),
    # Qwen3.5's decoder without its tower (Qwen3.8-2.4T-A95B's class): Qwen3-Next's layer kinds
    "Qwen3_5ForCausalLM": ("qwen3_5_text", False, True, False, True),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", False, True, True, True),
}
# Architectures whose routed experts sit beside a shared expert scaled by a sigmoid gate.
_GATED_SHARED_EXPERT = ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")
# The hybrid architectures that write their rotary settings under rope_parameters (Qwen3-Next's at the top level).
_ROPE_PARAMETERS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# What architecture_problems calls the hybrid switch (Qwen3.5's layer kinds).
_HYBRID = "layer_types set with attention_output_gate and zero_centered_norms"
# transformers' Qwen3NextConfig / Qwen3_5TextConfig defaults where a config.json names none.
_HYBRID_HEAD_DIM, _HYBRID_PARTIAL_ROTARY = 256, 0.25
HF_ARCHITECTURES = (*_ARCHITECTURES, *DEEPSEEK_ARCHITECTURES, MIMO_ARCHITECTURE)
HF_MODEL_TYPES = (*(model_type for model_type, *_ in _ARCHITECTURES.values()), *DEEPSEEK_ARCHITECTURES.values(),
                  MIMO_MODEL_TYPE)
# Llama 3.x "llama3" RoPE scaling, as megatron-core applies it (only the factor is configurable).
_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def architecture(lang: LanguageConfig) -> str:
    """The transformers class whose weights ``lang`` describes: the one it states (``architecture``), else
    the one its switches describe (a config saved before the architecture was stated)."""
    if lang.architecture is not None:
        return lang.architecture
    return _described_architecture(lang)


def _described_architecture(lang: LanguageConfig) -> str:
    if lang.multi_latent_attention is not None:
        return deepseek_architecture(lang)
    if lang.sliding_window is not None:
        return MIMO_ARCHITECTURE
    for name, (_, bias, qk_norm, experts, hybrid) in _ARCHITECTURES.items():
        if (lang.add_qkv_bias, lang.qk_norm, lang.moe is not None, bool(lang.layer_types)) == (
                bias, qk_norm, experts, hybrid):
            return name
    raise ValueError("model.language's add_qkv_bias, qk_norm and moe describe no transformers "
                     "text architecture (experts go with qk_norm (Qwen3-MoE) or qkv biases (Qwen2-MoE); qkv "
                     "biases and qk_norm never go together)")


def architecture_problems(lang: LanguageConfig) -> list[str]:
    """A stated architecture this project does not build, or whose fields the layers contradict: one line
    naming the key, the contradiction and the fix."""
    stated, key = lang.architecture, "model.language.architecture"
    if stated is None:
        return []
    if stated not in HF_ARCHITECTURES:
        return [f"{key}={stated} is not one of {', '.join(HF_ARCHITECTURES)}; state the decoder's transformers "
                "architecture (its config.json `architectures` entry)."]
    if stated in DEEPSEEK_ARCHITECTURES:
        if lang.multi_latent_attention is None:
            return [f"{key}={stated} needs model.language.multi_latent_attention; give it or state another "
                    "architecture."]
        described = deepseek_architecture(lang)
        sparse = set(SPARSE_ARCHITECTURES.values())
        if sparse & {stated, described} and described != stated:
            if stated not in sparse:
                wanted = "null"
            else:
                interleaved = stated == SPARSE_ARCHITECTURES[True]
                wanted = f"set with rope_interleaved: {str(interleaved).lower()}"
            return [f"{key}={stated} needs model.language.sparse_attention {wanted} (the indexer is what sets the "
                    "sparse architectures apart); make them agree."]
        if described != stated:
            return [f"{key}={stated} but model.language.moe.router_score_function="
                    f"{lang.moe.router_score_function} is {described}'s router; make them agree."]
        return []
    if stated == MIMO_ARCHITECTURE:
        return mimo_problems(lang)
    if lang.sliding_window is not None:
        return [f"{key}={stated} has no sliding-window layers; set model.language.sliding_window: null, or state an "
                f"architecture that has them."]
    _, bias, qk_norm, experts, hybrid = _ARCHITECTURES[stated]
    found = {"add_qkv_bias": lang.add_qkv_bias, "qk_norm": lang.qk_norm, "moe set": lang.moe is not None,
             "multi_latent_attention set": lang.multi_latent_attention is not None}
    wanted = {"add_qkv_bias": bias, "qk_norm": qk_norm, "moe set": experts, "multi_latent_attention set": False}
    hybrid_found = bool(lang.layer_types) and lang.attention_output_gate and lang.zero_centered_norms
    if hybrid or hybrid_found:  # named where either side has Qwen3-Next's hybrid layers
        found[_HYBRID], wanted[_HYBRID] = hybrid_found, hybrid
    if experts and lang.moe is not None:  # Qwen2-MoE's and Qwen3-Next's experts have a gated shared expert
        shared = "moe.shared_expert_ffn_hidden_size set with moe.shared_expert_gate"
        found[shared] = lang.moe.shared_expert_ffn_hidden_size is not None and lang.moe.shared_expert_gate
        wanted[shared] = stated in _GATED_SHARED_EXPERT
    if stated == "Qwen3_5MoeForCausalLM" and lang.moe is not None:  # its router always renormalises the top-k
        found["moe.norm_topk_prob"], wanted["moe.norm_topk_prob"] = lang.moe.norm_topk_prob, True
    wrong = [f"{name}: {str(found[name]).lower()}" for name in found if found[name] != wanted[name]]
    if wrong:
        return [f"{key}={stated} but model.language has {', '.join(wrong)}; {stated} has "
                + ", ".join(f"{name}: {str(wanted[name]).lower()}" for name in found) + "."]
    return []


def text_architecture_problems(model_cfg: ModelConfig) -> list[str]:
    """``ModelFamily.config_problems`` of a family whose decoder is a stated text architecture."""
    return architecture_problems(model_cfg.language)


def architecture_of(cfg: Mapping[str, Any], where: str) -> str:
    """The architecture a text config.json names (by ``architectures``, else ``model_type``)."""
    for name in cfg.get("architectures") or []:
        if name in HF_ARCHITECTURES:
            return name
    model_types = {**{model_type: name for name, (model_type, *_) in _ARCHITECTURES.items()},
                   **{model_type: name for name, model_type in DEEPSEEK_ARCHITECTURES.items()},
                   MIMO_MODEL_TYPE: MIMO_ARCHITECTURE}
    if cfg.get("model_type") in model_types:
        return model_types[cfg["model_type"]]
    raise InputError(f"{where}: neither architectures nor model_type names one of {', '.join(HF_ARCHITECTURES)}")


def _rope_scaling(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``LanguageConfig`` fields of a text config's RoPE scaling (none, llama3 or dynamic NTK)."""
    scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {}
    if kind not in ("llama3", "dynamic"):
        raise InputError(f"{where}: rope_scaling type {kind!r} is not supported; loongforge reads llama3 and "
                         f"dynamic scaling")
    for key, expected in (_LLAMA3_SCALING.items() if kind == "llama3" else ()):
        if float(scaling.get(key, expected)) != expected:
            raise InputError(f"{where}: rope_scaling.{key}={scaling[key]} but loongforge's llama3 scaling "
                             f"uses {expected}")
    return {"rope_scaling_factor": float(scaling["factor"]), "rope_scaling_type": kind}


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0)))


def language_from_hf(cfg: Mapping[str, Any], where: str, name: str | None = None) -> LanguageConfig:
    """``LanguageConfig`` from a text config (``name``: its architecture when the dict does not say it,
    as a VLM's ``text_config`` may not); KeyError for a missing required key (the caller names the file)."""
    name = name or architecture_of(cfg, where)
    if name in DEEPSEEK_ARCHITECTURES:
        return deepseek_from_hf(cfg, where, name)
    if name == MIMO_ARCHITECTURE:
        return mimo_from_hf(cfg, where)
    _, bias, qk_norm, experts, hybrid = _ARCHITECTURES[name]
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key) and not bias:
            raise InputError(f"{where}: {key}=true is not supported (Llama-style models train here without "
                             f"attention or MLP biases)")
    heads = cfg["num_attention_heads"]
    channels = cfg.get("head_dim") or (_HYBRID_HEAD_DIM if hybrid else cfg["hidden_size"] // heads)
    if experts and hybrid and "intermediate_size" not in cfg:
        # Every layer is sparse, and a Qwen3.5-MoE config.json may name no dense MLP width (Qwen3.6-35B-A3B's): the
        # unused ffn_hidden_size reads as the experts' width.
        cfg = {**cfg, "intermediate_size": cfg["moe_intermediate_size"]}
    return LanguageConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads", heads), vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(cfg), mrope_section=[],
        max_position_embeddings=cfg.get("max_position_embeddings", 32_768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        add_qkv_bias=bias,
        # Qwen3 configs always state it (transformers' Qwen3 default is 128, not hidden/heads).
        head_dim=channels if qk_norm or channels * heads != cfg["hidden_size"] else None,
        qk_norm=qk_norm,
        **_rope_scaling(cfg, where),
        architecture=name,
        **(_experts_from_hf(cfg, where, name) if experts else {}),
        **(_hybrid_from_hf(cfg) if hybrid else {}),
    )


def _experts_from_hf(cfg: Mapping[str, Any], where: str, name: str) -> dict[str, Any]:
    """The expert section; Qwen2-MoE's has a shared expert (its output scaled by a sigmoid gate) beside the
    routed ones, and leaves the top-k unrenormalised unless its config says otherwise."""
    if name == "Qwen3MoeForCausalLM":
        return experts_from_hf(cfg, where, model="Qwen3-MoE")
    if name == "Qwen3NextForCausalLM":  # renormalises the top-k unless its config says otherwise
        experts = experts_from_hf(cfg, where, model="Qwen3-Next")
    elif name == "Qwen3_5MoeForCausalLM":  # transformers' Qwen3.5-MoE router always renormalises the top-k
        experts = experts_from_hf(cfg, where, model="Qwen3.5-MoE")
        experts = {"moe": dataclasses.replace(experts["moe"], norm_topk_prob=True)}
    else:
        experts = experts_from_hf({"norm_topk_prob": False, **cfg}, where, model="Qwen2-MoE")
    shared = cfg["shared_expert_intermediate_size"]
    if not isinstance(shared, int) or shared < 1:
        raise InputError(f"{where}: shared_expert_intermediate_size={shared}: loongforge's {name} has a shared "
                         "expert of width >= 1")
    return {"moe": dataclasses.replace(experts["moe"], shared_expert_ffn_hidden_size=shared)}


def _partial_rotary_factor(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", _HYBRID_PARTIAL_ROTARY)))


def _hybrid_from_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's layer kinds (Qwen3.5's): Gated DeltaNet layers between gated full-attention ones, every
    RMSNorm zero-centred (neither switch is a config key: the class always has them), partial 1-D RoPE."""
    layer_types = hybrid_layer_types(cfg)
    linear = linear_attention_from_hf(cfg) if "linear_attention" in layer_types else None
    return dict(layer_types=layer_types, linear_attention=linear, attention_output_gate=True,
                zero_centered_norms=True, partial_rotary_factor=_partial_rotary_factor(cfg))


def language_to_hf(lang: LanguageConfig) -> dict[str, Any]:
    """The text config fields of ``lang`` (with ``architectures`` and ``model_type``)."""
    name = architecture(lang)
    if name in DEEPSEEK_ARCHITECTURES:
        return deepseek_to_hf(lang)
    if name == MIMO_ARCHITECTURE:
        return mimo_to_hf(lang)
    config: dict[str, Any] = {
        "architectures": [name],
        "model_type": _ARCHITECTURES[name][0],
        "hidden_size": lang.hidden_size,
        "intermediate_size": lang.ffn_hidden_size,
        "num_hidden_layers": lang.num_layers,
        "num_attention_heads": lang.num_attention_heads,
        "num_key_value_heads": lang.num_query_groups,
        "head_dim": lang.head_dim or lang.hidden_size // lang.num_attention_heads,
        "vocab_size": lang.vocab_size,
        "rms_norm_eps": lang.rms_norm_eps,
        "max_position_embeddings": lang.max_position_embeddings,
        "rope_theta": lang.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": lang.tie_word_embeddings,
    }
    if name == "LlamaForCausalLM":
        config.update(attention_bias=False, mlp_bias=False)
    if lang.moe:
        config.update(experts_to_hf(lang))
    if name in _GATED_SHARED_EXPERT:
        config["shared_expert_intermediate_size"] = lang.moe.shared_expert_ffn_hidden_size
    if name == "Qwen2MoeForCausalLM":
        config["qkv_bias"] = True
    if _ARCHITECTURES[name][4]:  # hybrid layers
        config.update(attention_bias=False, partial_rotary_factor=lang.partial_rotary_factor,
                      **hybrid_layers_to_hf(lang))
    if name in _ROPE_PARAMETERS:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": lang.rope_theta,
                                     "partial_rotary_factor": lang.partial_rotary_factor}
    if lang.rope_scaling_factor is not None:
        config["rope_scaling"] = {"rope_type": lang.rope_scaling_type, "factor": lang.rope_scaling_factor,
                                  **(_LLAMA3_SCALING if lang.rope_scaling_type == "llama3" else {})}
    return config
