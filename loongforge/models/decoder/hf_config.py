"""The decoder's routed-expert fields of an HF ``config.json``, both ways: the one reading of them
that Qwen3-MoE (``llm``, top level) and Qwen3-VL-MoE (``qwen3_vl``, under ``text_config``) share; and a hybrid
decoder's layer kinds and Gated DeltaNet shape, which Qwen3.5 (under ``text_config``) and Qwen3-Next (top level)
write alike.

transformers makes layer ``l`` sparse when ``l`` is not in ``mlp_only_layers`` and
``(l + 1) % decoder_sparse_step == 0``; loongforge builds every decoder layer alike, so only the
published setting (every layer sparse) is read.
"""

from __future__ import annotations

from typing import Any, Mapping

from loongforge.config.errors import InputError
from loongforge.config.schema import LanguageConfig, LinearAttentionConfig, MoEConfig


def experts_from_hf(cfg: Mapping[str, Any], where: str, *, model: str, key_prefix: str = "") -> dict[str, Any]:
    """``LanguageConfig``'s expert section (``moe``) from the decoder's part of a config.json (``cfg``); errors
    name the file (``where``) and the key (``key_prefix``: where ``cfg`` sits in the file)."""
    step, dense = cfg.get("decoder_sparse_step", 1), list(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise InputError(f"{where}: {key_prefix}decoder_sparse_step={step}, {key_prefix}mlp_only_layers={dense}: "
                         f"loongforge's {model} makes every layer sparse (decoder_sparse_step 1, no mlp_only_layers)")
    # The Hub's config.json says num_experts; transformers 5 writes it as num_local_experts.
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not isinstance(experts, int) or experts < 1:
        raise InputError(f"{where}: a {model} config needs {key_prefix}num_experts (or "
                         f"{key_prefix}num_local_experts) >= 1, got {experts}")
    return dict(moe=MoEConfig(num_experts=experts, ffn_hidden_size=cfg["moe_intermediate_size"],
                              router_topk=cfg.get("num_experts_per_tok", 8),
                              norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                              aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.001))))


def experts_to_hf(lang: LanguageConfig) -> dict[str, Any]:
    """The config.json expert fields of ``lang`` (a model with experts): every layer sparse."""
    return dict(num_experts=lang.moe.num_experts, moe_intermediate_size=lang.moe.ffn_hidden_size,
                num_experts_per_tok=lang.moe.router_topk, norm_topk_prob=lang.moe.norm_topk_prob,
                router_aux_loss_coef=lang.moe.aux_loss_coeff, decoder_sparse_step=1, mlp_only_layers=[])


# transformers' defaults for a hybrid decoder's config.json (Qwen3.5's and Qwen3-Next's configs share them):
# every fourth layer full attention when the file names no layer_types; Gated DeltaNet's shape.
DEFAULT_FULL_ATTENTION_INTERVAL = 4


def hybrid_layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """Each layer's token mixer: ``layer_types``, else every ``full_attention_interval``-th layer full attention
    (older files, and the Hub's Qwen3-Next, name only the interval)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    interval = cfg.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(cfg["num_hidden_layers"])]


def linear_attention_from_hf(cfg: Mapping[str, Any]) -> LinearAttentionConfig:
    """Gated DeltaNet's shape from the ``linear_*`` keys (transformers' defaults where a key is missing)."""
    default = LinearAttentionConfig()
    return LinearAttentionConfig(
        num_key_heads=cfg.get("linear_num_key_heads", default.num_key_heads),
        num_value_heads=cfg.get("linear_num_value_heads", default.num_value_heads),
        key_head_dim=cfg.get("linear_key_head_dim", default.key_head_dim),
        value_head_dim=cfg.get("linear_value_head_dim", default.value_head_dim),
        conv_kernel=cfg.get("linear_conv_kernel_dim", default.conv_kernel))


def hybrid_layers_to_hf(lang: LanguageConfig) -> dict[str, Any]:
    """``layer_types`` and Gated DeltaNet's ``linear_*`` keys of a hybrid decoder."""
    shape = lang.linear_attention or LinearAttentionConfig()
    return {"layer_types": list(lang.layer_types), "linear_num_key_heads": shape.num_key_heads,
            "linear_num_value_heads": shape.num_value_heads, "linear_key_head_dim": shape.key_head_dim,
            "linear_value_head_dim": shape.value_head_dim, "linear_conv_kernel_dim": shape.conv_kernel}
