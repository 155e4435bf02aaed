"""DeepSeek-V2 / V3 / V3.2 ``config.json`` fields (transformers' ``DeepseekV2Config`` / ``DeepseekV3Config`` /
``DeepseekV32Config``), both ways: multi-latent attention, YaRN, DeepSeekMoE routing (shared plus routed experts,
the first layers dense); V3.2 is V3 with DeepSeek Sparse Attention's indexer (``index_topk``, ``index_n_heads``,
``index_head_dim``: ``model.language.sparse_attention``). GLM-5 (transformers' ``GlmMoeDsaConfig``, a
``DeepseekV32Config``) is V3.2's model whose indexer rotates interleaved pairs (``sparse_attention.rope_interleaved``);
its layers that reuse another's top-k (``indexer_types`` "shared") are refused.

The two routers as transformers computes them: V3 takes a sigmoid per expert, adds the expert bias
(``e_score_correction_bias``) only to choose, limits the choice to the ``topk_group`` groups with the
largest sums of their top-2 scores and renormalises the chosen scores; V2 takes the softmax over all
experts and keeps the top-k as they are (``topk_method: greedy``). Both multiply by
``routed_scaling_factor``. megatron's group-limited routing sums the top (topk / topk_group) scores of
each group, so a V3 config is read only where that is 2, and V2's ``group_limited_greedy`` (a group's
largest score) only where it is 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from loongforge.config.errors import InputError
from loongforge.config.schema import LanguageConfig, MLAConfig, MoEConfig, SparseAttentionConfig, YarnConfig

DEEPSEEK_ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                          "DeepseekV32ForCausalLM": "deepseek_v32", "GlmMoeDsaForCausalLM": "glm_moe_dsa"}
# The architectures of V3's router and multi-token prediction (V3.2 is V3's model with sparse attention, GLM-5 V3.2's).
_V3_ROUTER = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
# The sparse-attention architectures, by whether their indexer rotates interleaved pairs.
SPARSE_ARCHITECTURES = {False: "DeepseekV32ForCausalLM", True: "GlmMoeDsaForCausalLM"}
# megatron's expert bias moves by this much per step (DeepSeek-V3's gamma for most of its pre-training).
BIAS_UPDATE_RATE = 1e-3
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def deepseek_architecture(lang: LanguageConfig) -> str:
    """V3.2 (or GLM-5, its indexer rotating pairs) with sparse attention, else V3's sigmoid router or V2's softmax
    one."""
    if lang.sparse_attention is not None:
        return SPARSE_ARCHITECTURES[lang.sparse_attention.rope_interleaved]
    sigmoid = lang.moe is not None and lang.moe.router_score_function == "sigmoid"
    return "DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"


def deepseek_from_hf(cfg: Mapping[str, Any], where: str, name: str) -> LanguageConfig:
    """``LanguageConfig`` of a DeepSeek-V2/V3/V3.2 config.json; KeyError for a missing required key."""
    v3 = name in _V3_ROUTER
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise InputError(f"{where}: {key}=true is not supported (DeepSeek models have no linear biases)")
    if cfg.get("rope_interleave", True) is False:
        raise InputError(f"{where}: rope_interleave=false: loongforge rotates DeepSeek's interleaved pairs "
                         "(megatron's multi-latent attention); set it to true")
    heads = cfg["num_attention_heads"]
    if cfg.get("num_key_value_heads", heads) != heads:
        raise InputError(f"{where}: num_key_value_heads={cfg['num_key_value_heads']} must equal "
                         f"num_attention_heads={heads} (multi-latent attention has a key and value per head)")
    experts = cfg.get("n_routed_experts")
    return LanguageConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads, num_query_groups=heads, vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(cfg), mrope_section=[],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), add_qkv_bias=False, architecture=name,
        multi_latent_attention=MLAConfig(
            q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"]),
        yarn=_yarn_from_hf(cfg, where),
        # DeepSeek-V3's multi-token-prediction layers (its checkpoint's layers after the decoder's).
        mtp_num_layers=int(cfg.get("num_nextn_predict_layers") or 0) if v3 else 0,
        sparse_attention=_sparse_attention_from_hf(cfg, where, name) if name in SPARSE_ARCHITECTURES.values() else None,
        **(_experts_from_hf(cfg, where, v3) if experts else {}),
    )


def _sparse_attention_from_hf(cfg: Mapping[str, Any], where: str, name: str) -> SparseAttentionConfig:
    """The indexer's settings; GLM-5's layers must each run their own (transformers' ``indexer_types`` all "full",
    as its ``index_topk_freq`` 1 and ``index_topk_pattern`` of F alone give)."""
    pattern = cfg.get("indexer_types") or cfg.get("index_topk_pattern") or ""
    if "shared" in pattern or "S" in pattern or int(cfg.get("index_topk_freq") or 1) > 1:
        raise InputError(f"{where}: layers that reuse another layer's top-k (indexer_types 'shared', "
                         "index_topk_freq > 1) are not built by loongforge; every layer runs its own indexer")
    return SparseAttentionConfig(index_topk=cfg["index_topk"], index_n_heads=cfg["index_n_heads"],
                                 index_head_dim=cfg["index_head_dim"],
                                 rope_interleaved=name == SPARSE_ARCHITECTURES[True])


def _experts_from_hf(cfg: Mapping[str, Any], where: str, v3: bool) -> dict[str, Any]:
    topk, groups, group_topk = cfg["num_experts_per_tok"], cfg.get("n_group"), cfg.get("topk_group")
    if groups in (None, 1):
        groups = group_topk = None
    elif v3 and topk // group_topk != 2:
        raise InputError(f"{where}: num_experts_per_tok={topk} / topk_group={group_topk} != 2: DeepSeek-V3 ranks "
                         "groups by their top-2 scores, megatron by their top (num_experts_per_tok / topk_group)")
    elif not v3 and (cfg.get("topk_method", "greedy") != "group_limited_greedy" or topk // group_topk != 1):
        raise InputError(f"{where}: topk_method={cfg.get('topk_method')!r} with n_group={groups}: loongforge reads "
                         "DeepSeek-V2's greedy routing, or group_limited_greedy with num_experts_per_tok == topk_group")
    if not v3 and cfg.get("norm_topk_prob"):
        raise InputError(f"{where}: norm_topk_prob=true: transformers' DeepSeek-V2 never renormalises the top-k "
                         "weights; set it to false")
    shared = cfg.get("n_shared_experts") or 0
    return dict(moe=MoEConfig(
        num_experts=cfg["n_routed_experts"], ffn_hidden_size=cfg["moe_intermediate_size"],
        router_topk=topk, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if v3 else False,
        aux_loss_coeff=0.0 if v3 else float(cfg.get("aux_loss_alpha", 0.001)),
        first_dense_layers=cfg.get("first_k_dense_replace") or 0,
        router_score_function="sigmoid" if v3 else "softmax", router_fp32=True,
        router_bias_update_rate=BIAS_UPDATE_RATE if v3 else 0.0,
        router_num_groups=groups, router_group_topk=group_topk,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        shared_expert_ffn_hidden_size=shared * cfg["moe_intermediate_size"] if shared else None,
        shared_expert_gate=False))


def _rope_parameters(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    return float(_rope_parameters(cfg).get("rope_theta", cfg.get("rope_theta", 10_000.0)))


def _yarn_from_hf(cfg: Mapping[str, Any], where: str) -> YarnConfig | None:
    scaling = _rope_parameters(cfg)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise InputError(f"{where}: rope_scaling type {kind!r} is not supported for DeepSeek models; loongforge "
                         "reads yarn (or none)")
    defaults = YarnConfig()
    return YarnConfig(**{key: type(getattr(defaults, key))(scaling[key]) if scaling.get(key) is not None
                         else getattr(defaults, key) for key in _YARN_KEYS})


def deepseek_to_hf(lang: LanguageConfig) -> dict[str, Any]:
    """The config.json of a DeepSeek-V2/V3/V3.2 ``lang``."""
    name, mla = deepseek_architecture(lang), lang.multi_latent_attention
    config: dict[str, Any] = {
        "architectures": [name], "model_type": DEEPSEEK_ARCHITECTURES[name],
        "vocab_size": lang.vocab_size, "hidden_size": lang.hidden_size, "intermediate_size": lang.ffn_hidden_size,
        "num_hidden_layers": lang.num_layers, "num_attention_heads": lang.num_attention_heads,
        "num_key_value_heads": lang.num_attention_heads, "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "hidden_act": "silu",
        "max_position_embeddings": lang.max_position_embeddings, "rms_norm_eps": lang.rms_norm_eps,
        "tie_word_embeddings": lang.tie_word_embeddings, "rope_theta": lang.rope_theta, "rope_interleave": True,
        "attention_bias": False,
    }
    if lang.yarn is not None:
        config["rope_scaling"] = {"rope_type": "yarn", **{key: getattr(lang.yarn, key) for key in _YARN_KEYS}}
    if name in _V3_ROUTER:
        config["num_nextn_predict_layers"] = lang.mtp_num_layers
    if lang.sparse_attention is not None:
        sparse = lang.sparse_attention
        config.update(index_topk=sparse.index_topk, index_n_heads=sparse.index_n_heads,
                      index_head_dim=sparse.index_head_dim)
    if lang.moe:
        shared = lang.moe.shared_expert_ffn_hidden_size or 0
        config.update(
            n_routed_experts=lang.moe.num_experts, moe_intermediate_size=lang.moe.ffn_hidden_size,
            num_experts_per_tok=lang.moe.router_topk, norm_topk_prob=lang.moe.norm_topk_prob,
            first_k_dense_replace=lang.moe.first_dense_layers, routed_scaling_factor=lang.moe.routed_scaling_factor,
            n_shared_experts=shared // lang.moe.ffn_hidden_size, n_group=lang.moe.router_num_groups or 1,
            topk_group=lang.moe.router_group_topk or 1)
        if name == "DeepseekV2ForCausalLM":
            config.update(topk_method="group_limited_greedy" if lang.moe.router_num_groups else "greedy",
                          aux_loss_alpha=lang.moe.aux_loss_coeff)
    return config


def mtp_layers_held(model_cfg, keys: Collection[str], hf_prefix: str = "model."):
    """``model_cfg`` with only the multi-token-prediction layers whose projection ``keys`` hold (DeepSeek's
    checkpoint holds its MTP layer after the decoder's; transformers' writes ``num_nextn_predict_layers: 1``
    and none)."""
    lang = model_cfg.language
    held = 0
    while held < lang.mtp_num_layers and f"{hf_prefix}layers.{lang.num_layers + held}.eh_proj.weight" in keys:
        held += 1
    if held == lang.mtp_num_layers:
        return model_cfg
    return dataclasses.replace(model_cfg, language=dataclasses.replace(lang, mtp_num_layers=held))
