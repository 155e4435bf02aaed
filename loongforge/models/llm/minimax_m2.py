"""MiniMax-M2 (transformers' ``MiniMaxM2ForCausalLM``, model_type ``minimax_m2``): the shared decoder with

- GQA attention without biases whose q/k RMSNorms span all heads at once (``qk_norm_type: per_layer``: one norm over
  the whole query projection, one over the whole key projection, a weight per channel; ``decoder.layer_qk_norm``),
  RoPE on the first ``rotary_dim`` channels of each head (``partial_rotary_factor``);
- routed experts in every layer and no shared expert: a sigmoid score per expert, the expert bias
  (``e_score_correction_bias``) added only to choose the top-k, the chosen unbiased scores renormalised (megatron's
  sigmoid router with its expert bias, as DeepSeek-V3's without groups or scaling).

Its checkpoints keep Mixtral's key layout for the experts, per layer ``N`` (the decoder's names on the right)::

    model.layers.N.block_sparse_moe.gate.weight                 mlp.gate.weight
    model.layers.N.block_sparse_moe.e_score_correction_bias     mlp.gate.e_score_correction_bias
    model.layers.N.block_sparse_moe.experts.E.w1.weight         mlp.experts.E.gate_proj.weight
    model.layers.N.block_sparse_moe.experts.E.w3.weight         mlp.experts.E.up_proj.weight
    model.layers.N.block_sparse_moe.experts.E.w2.weight         mlp.experts.E.down_proj.weight

transformers 5 holds them as ``mlp.gate.weight``, ``mlp.e_score_correction_bias`` and the fused
``mlp.experts.gate_up_proj`` / ``down_proj`` in memory and writes the Hub's names. Its config.json states
``router_aux_loss_coef`` for an inference class that computes no balance loss unless asked; loongforge balances
MiniMax-M2's experts by the expert bias (``moe.router_bias_update_rate``) and writes 0. The published checkpoint's
multi-token-prediction modules (``num_mtp_modules``) are not part of transformers' class and are not read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from loongforge.config.errors import InputError
from loongforge.config.schema import LanguageConfig, MoEConfig
from loongforge.models.decoder.deepseek_config import BIAS_UPDATE_RATE
from loongforge.models.decoder.hf_mapping import hub_experts, language_hf_shapes, language_rules
from loongforge.models.hf.rules import Rule

MINIMAX_M2_ARCHITECTURE, MINIMAX_M2_MODEL_TYPE = "MiniMaxM2ForCausalLM", "minimax_m2"
# the decoder's Hub names -> MiniMax-M2's (Mixtral's expert layout)
_KEY_LAYOUT = ((re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".block_sparse_moe.e_score_correction_bias"),
               (re.compile(r"\.mlp\.gate\.weight$"), ".block_sparse_moe.gate.weight"),
               (re.compile(r"\.mlp\.experts\.([^.]+)\.gate_proj\.weight$"), r".block_sparse_moe.experts.\1.w1.weight"),
               (re.compile(r"\.mlp\.experts\.([^.]+)\.up_proj\.weight$"), r".block_sparse_moe.experts.\1.w3.weight"),
               (re.compile(r"\.mlp\.experts\.([^.]+)\.down_proj\.weight$"), r".block_sparse_moe.experts.\1.w2.weight"))
_IN_MEMORY_BIAS = ".mlp.e_score_correction_bias"  # transformers 5's module name of the expert bias


def is_minimax_m2_config(cfg: Mapping[str, Any]) -> bool:
    return MINIMAX_M2_ARCHITECTURE in (cfg.get("architectures") or []) or cfg.get("model_type") == MINIMAX_M2_MODEL_TYPE


def minimax_m2_language_from_hf(cfg: Mapping[str, Any], where: str) -> LanguageConfig:
    """The decoder of a MiniMax-M2 config.json; KeyError for a missing required key."""
    heads, channels = cfg["num_attention_heads"], cfg["head_dim"]
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise InputError(f"{where}: scoring_func={cfg['scoring_func']!r}: transformers' MiniMax-M2 scores experts by "
                         "a sigmoid")
    if cfg.get("shared_intermediate_size") or 0:
        raise InputError(f"{where}: shared_intermediate_size={cfg['shared_intermediate_size']}: transformers' "
                         "MiniMax-M2 has no shared expert; set it to 0")
    if any(kind != 1 for kind in cfg.get("attn_type_list") or []):
        raise InputError(f"{where}: attn_type_list holds {sorted(set(cfg['attn_type_list']))}: transformers' "
                         "MiniMax-M2 has full attention (1) in every layer")
    params = cfg.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is None:
        partial = cfg.get("rotary_dim", channels) / channels
    width = cfg["intermediate_size"]  # each expert's (transformers' MiniMax-M2 has no dense MLP)
    return LanguageConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], ffn_hidden_size=width,
        num_attention_heads=heads, num_query_groups=cfg.get("num_key_value_heads", heads), vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 5_000_000.0))), mrope_section=[],
        max_position_embeddings=cfg.get("max_position_embeddings", 196_608),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), add_qkv_bias=False, head_dim=channels,
        qk_norm=True, qk_norm_type="per_layer", partial_rotary_factor=float(partial),
        architecture=MINIMAX_M2_ARCHITECTURE,
        moe=MoEConfig(num_experts=cfg.get("num_local_experts", cfg.get("num_experts", 256)), ffn_hidden_size=width,
                      router_topk=cfg.get("num_experts_per_tok", 8), norm_topk_prob=True, aux_loss_coeff=0.0,
                      router_score_function="sigmoid", router_fp32=True, router_bias_update_rate=BIAS_UPDATE_RATE))


def minimax_m2_language_to_hf(lang: LanguageConfig) -> dict[str, Any]:
    """MiniMax-M2's config.json fields of ``lang`` (the published file's keys)."""
    channels = lang.head_dim
    return {"architectures": [MINIMAX_M2_ARCHITECTURE], "model_type": MINIMAX_M2_MODEL_TYPE,
            "hidden_size": lang.hidden_size, "intermediate_size": lang.moe.ffn_hidden_size,
            "num_hidden_layers": lang.num_layers, "num_attention_heads": lang.num_attention_heads,
            "num_key_value_heads": lang.num_query_groups, "head_dim": channels, "vocab_size": lang.vocab_size,
            "rms_norm_eps": lang.rms_norm_eps, "rope_theta": lang.rope_theta,
            "rotary_dim": int(channels * lang.partial_rotary_factor),
            "max_position_embeddings": lang.max_position_embeddings, "hidden_act": "silu",
            "tie_word_embeddings": lang.tie_word_embeddings, "num_local_experts": lang.moe.num_experts,
            "num_experts_per_tok": lang.moe.router_topk, "router_aux_loss_coef": lang.moe.aux_loss_coeff,
            "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True, "qk_norm_type": "per_layer",
            "shared_intermediate_size": 0, "attn_type_list": [1] * lang.num_layers}


def minimax_m2_problems(lang: LanguageConfig) -> list[str]:
    """What transformers' MiniMax-M2 cannot be: one line naming the keys and the values it needs."""
    moe = lang.moe
    found = {
        "add_qkv_bias": lang.add_qkv_bias, "qk_norm": lang.qk_norm, "qk_norm_type": lang.qk_norm_type,
        "head_dim set": lang.head_dim is not None, "moe set": moe is not None,
        "multi_latent_attention set": lang.multi_latent_attention is not None, "layer_types": lang.layer_types,
        "attention_output_gate": lang.attention_output_gate,
    }
    wanted = {"add_qkv_bias": False, "qk_norm": True, "qk_norm_type": "per_layer", "head_dim set": True,
              "moe set": True, "multi_latent_attention set": False, "layer_types": [], "attention_output_gate": False}
    if moe is not None:
        found.update({"moe.router_score_function": moe.router_score_function, "moe.norm_topk_prob": moe.norm_topk_prob,
                      "moe.router_bias_update_rate > 0": moe.router_bias_update_rate > 0,
                      "moe.shared_expert_ffn_hidden_size": moe.shared_expert_ffn_hidden_size,
                      "moe.first_dense_layers": moe.first_dense_layers, "moe.router_num_groups": moe.router_num_groups,
                      "moe.routed_scaling_factor": moe.routed_scaling_factor})
        wanted.update({"moe.router_score_function": "sigmoid", "moe.norm_topk_prob": True,
                       "moe.router_bias_update_rate > 0": True, "moe.shared_expert_ffn_hidden_size": None,
                       "moe.first_dense_layers": 0, "moe.router_num_groups": None, "moe.routed_scaling_factor": 1.0})
    wrong = [f"{name}: {found[name]} (needs {wanted[name]})" for name in found if found[name] != wanted[name]]
    if not wrong:
        return []
    return [f"model.language.architecture={MINIMAX_M2_ARCHITECTURE} but model.language has {', '.join(wrong)}."]


def _hub_key(key: str) -> str:
    for pattern, replacement in _KEY_LAYOUT:
        key = pattern.sub(replacement, key)
    return key


def minimax_m2_rules(lang: LanguageConfig) -> list[Rule]:
    """The decoder's rows under MiniMax-M2's key layout (the module docstring's table)."""
    return [dataclasses.replace(rule, hf=tuple(_hub_key(key) for key in rule.hf),
                                fallback_hf=rule.fallback_hf and _hub_key(rule.fallback_hf))
            for rule in language_rules(lang)]


def minimax_m2_hf_shapes(lang: LanguageConfig) -> dict[str, tuple[int, ...]]:
    return {_hub_key(key): shape for key, shape in language_hf_shapes(lang).items()}


def minimax_m2_hub_style(hf_state: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5's in-memory MiniMax-M2 (its expert bias under ``mlp.``, fused experts) -> the Hub's names;
    any other state dict unchanged."""
    if not any(key.endswith(_IN_MEMORY_BIAS) for key in hf_state):
        return dict(hf_state)
    renamed = {key[: -len(_IN_MEMORY_BIAS)] + ".mlp.gate.e_score_correction_bias" if key.endswith(_IN_MEMORY_BIAS)
               else key: value for key, value in hf_state.items()}
    return {_hub_key(key): value for key, value in hub_experts(renamed).items()}
