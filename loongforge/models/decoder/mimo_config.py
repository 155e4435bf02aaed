"""MiMo-V2-Flash's ``config.json`` fields (transformers' ``MiMoV2FlashConfig``), both ways.

What the decoder is: GQA attention whose queries and keys have ``head_dim`` channels and values
``v_head_dim``, the values times ``attention_value_scale``, the first ``partial_rotary_factor`` of each
head rotated; ``layer_types`` names each layer ``full_attention`` or ``sliding_attention``, and the sliding
ones have twice the key/value heads, a window of ``sliding_window`` tokens (the query included), a
learned sink logit per head and RoPE of their own theta (``rope_parameters`` per layer type);
``mlp_layer_types`` names each MLP ``dense`` or ``sparse``: the routed experts, DeepSeek-V3's sigmoid
router with the expert bias, no shared expert. All of it is ``model.language.sliding_window`` plus the
shared fields.

The Hub's own config.json (XiaomiMiMo/MiMo-V2-Flash) states ``sliding_window_size`` (one less than
transformers' window: the tokens before the query), which transformers reads as ``sliding_window``; read so here.
Its multi-token-prediction layers (``model.mtp.*``) are no part of transformers' class, which ignores them on
loading: they are not read (``num_nextn_predict_layers`` is written 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loongforge.config.errors import InputError
from loongforge.config.schema import LanguageConfig, MoEConfig, SlidingWindowConfig
from loongforge.models.decoder.deepseek_config import BIAS_UPDATE_RATE

MIMO_ARCHITECTURE, MIMO_MODEL_TYPE = "MiMoV2FlashForCausalLM", "mimo_v2_flash"
FULL, SLIDING = "full_attention", "sliding_attention"
_DEFAULT_ROPE = {FULL: {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                 SLIDING: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}


def default_layer_types(num_layers: int) -> list[str]:
    """transformers' default pattern: the first layer and every sixth full attention, the rest sliding."""
    return [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]


def mimo_from_hf(cfg: Mapping[str, Any], where: str) -> LanguageConfig:
    """``LanguageConfig`` of a MiMo-V2-Flash config.json; KeyError for a missing required key."""
    if cfg.get("attention_bias"):
        raise InputError(f"{where}: attention_bias=true is not supported (MiMo-V2-Flash has no attention biases)")
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    layer_types = list(cfg.get("layer_types") or default_layer_types(layers))
    mlp_types = list(cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1))
    dense = next((i for i, kind in enumerate(mlp_types) if kind == "sparse"), layers)
    if mlp_types != ["dense"] * dense + ["sparse"] * (layers - dense):
        raise InputError(f"{where}: mlp_layer_types={mlp_types}: loongforge builds dense MLPs in the first layers "
                         "and experts in the rest")
    rope = cfg.get("rope_parameters") or _DEFAULT_ROPE
    full_rope, sliding_rope = rope.get(FULL) or _DEFAULT_ROPE[FULL], rope.get(SLIDING) or _DEFAULT_ROPE[SLIDING]
    for kind, params in ((FULL, full_rope), (SLIDING, sliding_rope)):
        if params.get("rope_type", "default") != "default":
            raise InputError(f"{where}: rope_parameters.{kind}.rope_type={params['rope_type']!r}: loongforge reads "
                             "plain RoPE for MiMo-V2-Flash")
    factor = float(full_rope.get("partial_rotary_factor", 0.334))
    if float(sliding_rope.get("partial_rotary_factor", 0.334)) != factor:
        raise InputError(f"{where}: the two layer types rotate different shares of a head; loongforge reads one")
    window = cfg["sliding_window_size"] + 1 if cfg.get("sliding_window_size") is not None else cfg.get("sliding_window", 129)
    scale = cfg.get("attention_value_scale", 0.707)
    groups = cfg.get("num_key_value_heads", heads)
    return LanguageConfig(
        num_layers=layers, hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads, num_query_groups=groups, vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(full_rope["rope_theta"]), mrope_section=[],
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), add_qkv_bias=False,
        head_dim=cfg.get("head_dim", 192), partial_rotary_factor=factor, layer_types=layer_types,
        architecture=MIMO_ARCHITECTURE,
        sliding_window=SlidingWindowConfig(
            size=int(window), num_query_groups=2 * groups, rope_theta=float(sliding_rope["rope_theta"]), sinks=True,
            v_head_dim=cfg.get("v_head_dim", 128), value_scale=1.0 if scale is None else float(scale)),
        moe=_experts_from_hf(cfg, where, dense) if dense < layers else None,
    )


def _experts_from_hf(cfg: Mapping[str, Any], where: str, dense: int) -> MoEConfig:
    """DeepSeek-V3's router (sigmoid scores, the expert bias to choose, renormalised top-k, scaled) without
    a shared expert."""
    topk, groups, group_topk = cfg.get("num_experts_per_tok", 8), cfg.get("n_group", 1), cfg.get("topk_group", 1)
    if groups in (None, 1):
        groups = group_topk = None
    elif topk // group_topk != 2:
        raise InputError(f"{where}: num_experts_per_tok={topk} / topk_group={group_topk} != 2: MiMo-V2-Flash ranks "
                         "groups by their top-2 scores, megatron by their top (num_experts_per_tok / topk_group)")
    if not cfg.get("norm_topk_prob", True):
        raise InputError(f"{where}: norm_topk_prob=false: megatron-core renormalises the top-k sigmoid scores")
    return MoEConfig(
        num_experts=cfg.get("n_routed_experts", 256), ffn_hidden_size=cfg.get("moe_intermediate_size", 2048),
        router_topk=topk, norm_topk_prob=True, aux_loss_coeff=0.0, first_dense_layers=dense,
        router_score_function="sigmoid", router_fp32=True, router_bias_update_rate=BIAS_UPDATE_RATE,
        router_num_groups=groups, router_group_topk=group_topk,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        shared_expert_ffn_hidden_size=None, shared_expert_gate=False)


def mimo_to_hf(lang: LanguageConfig) -> dict[str, Any]:
    """The config.json (transformers' field names) of a MiMo-V2-Flash ``lang``."""
    window, moe = lang.sliding_window, lang.moe
    dense = lang.num_layers if moe is None else moe.first_dense_layers
    rope = {kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": lang.partial_rotary_factor}
            for kind, theta in ((FULL, lang.rope_theta), (SLIDING, window.rope_theta))}
    config: dict[str, Any] = {
        "architectures": [MIMO_ARCHITECTURE], "model_type": MIMO_MODEL_TYPE,
        "vocab_size": lang.vocab_size, "hidden_size": lang.hidden_size, "intermediate_size": lang.ffn_hidden_size,
        "num_hidden_layers": lang.num_layers, "num_attention_heads": lang.num_attention_heads,
        "num_key_value_heads": lang.num_query_groups, "head_dim": lang.head_dim, "v_head_dim": window.v_head_dim,
        "hidden_act": "silu", "max_position_embeddings": lang.max_position_embeddings,
        "rms_norm_eps": lang.rms_norm_eps, "tie_word_embeddings": lang.tie_word_embeddings,
        "attention_bias": False, "sliding_window": window.size, "layer_types": list(lang.layer_types),
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (lang.num_layers - dense),
        "rope_parameters": rope, "attention_value_scale": window.value_scale,
    }
    if moe is not None:
        config.update(n_routed_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden_size,
                      num_experts_per_tok=moe.router_topk, norm_topk_prob=moe.norm_topk_prob,
                      routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.router_num_groups or 1,
                      topk_group=moe.router_group_topk or 1)
    return config


def mimo_problems(lang: LanguageConfig) -> list[str]:
    """What MiMo-V2-Flash's class cannot describe: one line each, naming the key."""
    key, window, errors = "model.language", lang.sliding_window, []
    if window is None:
        return [f"{key}.architecture={MIMO_ARCHITECTURE} needs {key}.sliding_window; give it or state another "
                "architecture."]
    if window.num_query_groups != 2 * lang.num_query_groups or not window.sinks:
        errors.append(f"{key}.sliding_window: MiMo-V2-Flash's sliding layers have twice the full layers' key/value "
                      f"heads ({2 * lang.num_query_groups}) and sinks; set num_query_groups: "
                      f"{2 * lang.num_query_groups}, sinks: true.")
    if set(lang.layer_types) - {FULL, SLIDING} or lang.linear_attention is not None:
        errors.append(f"{key}.layer_types={lang.layer_types}: MiMo-V2-Flash's layers are full_attention or "
                      "sliding_attention.")
    if lang.add_qkv_bias or lang.qk_norm or lang.attention_output_gate or lang.multi_latent_attention is not None:
        errors.append(f"{key}: MiMo-V2-Flash has no q/k/v biases, q/k norms, output gate or latent attention; set "
                      "add_qkv_bias, qk_norm, attention_output_gate: false and multi_latent_attention: null.")
    moe = lang.moe
    if moe is not None and (moe.shared_expert_ffn_hidden_size is not None or moe.router_score_function != "sigmoid"
                            or moe.router_bias_update_rate <= 0):
        errors.append(f"{key}.moe: MiMo-V2-Flash routes by sigmoid scores with the expert bias and no shared expert; "
                      "set router_score_function: sigmoid, router_bias_update_rate > 0, "
                      "shared_expert_ffn_hidden_size: null.")
    if lang.mtp_num_layers:
        errors.append(f"{key}.mtp_num_layers={lang.mtp_num_layers}: transformers' MiMo-V2-Flash has no MTP layers "
                      "(it ignores the checkpoint's model.mtp.*); set 0.")
    return errors
