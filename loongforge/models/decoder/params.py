"""Decoder parameter counts by arithmetic on the config: no tensors are allocated.

Counts use the true vocabulary (as published), not megatron's TP padding; tied embeddings count once.
A hybrid decoder (Qwen3.5, ``model.language.layer_types``) counts each layer by its token mixer: gated
full attention or Gated DeltaNet's linear attention; the norms and the MLP (or experts) are the same in
both.
"""

from __future__ import annotations

from collections import Counter

from loongforge.config.schema import LanguageConfig, ModelConfig
from loongforge.models.flops import FULL_ATTENTION, LINEAR_ATTENTION, decoder_layer_types, sparse_layers


def head_dim(lang: LanguageConfig) -> int:
    """Channels per attention head: ``model.language.head_dim``, else hidden / heads."""
    return lang.head_dim or lang.hidden_size // lang.num_attention_heads


def linear_parameters(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def expert_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """One layer's routed experts, router not included (0 in a dense model); ``active``: the
    ``moe_router_topk`` experts one token runs through."""
    if not lang.num_experts:
        return 0
    experts = lang.moe_router_topk if active else lang.num_experts
    return experts * 3 * linear_parameters(lang.hidden_size, lang.moe_ffn_hidden_size, bias=False)


def mlp_parameters(lang: LanguageConfig, *, active: bool = False, sparse: bool = True) -> int:
    """One layer's SwiGLU MLP; with experts (``sparse``), the router plus every expert (``active``: the
    router plus the ``moe_router_topk`` experts one token runs through) plus the shared expert, if any.
    The router's expert bias (DeepSeek-V3) is a buffer, not a parameter, as in transformers."""
    if not lang.num_experts or not sparse:
        return 3 * linear_parameters(lang.hidden_size, lang.ffn_hidden_size, bias=False)
    router = linear_parameters(lang.hidden_size, lang.num_experts, bias=False)
    return router + expert_parameters(lang, active=active) + shared_expert_parameters(lang)


def shared_expert_parameters(lang: LanguageConfig) -> int:
    """The shared expert (every token runs through it): a SwiGLU MLP of ``moe_shared_expert_ffn_hidden_size``
    and, gated (Qwen3.5-MoE), its gate ``h -> 1``; 0 without one."""
    if not lang.moe_shared_expert_ffn_hidden_size:
        return 0
    h = lang.hidden_size
    gate = linear_parameters(h, 1, bias=False) if lang.moe_shared_expert_gate else 0
    return 3 * linear_parameters(h, lang.moe_shared_expert_ffn_hidden_size, bias=False) + gate


def latent_attention_parameters(lang: LanguageConfig) -> int:
    """Multi-latent attention (transformers' ``DeepseekV3Attention``): q_a_proj [q_lora, h] with its RMSNorm and
    q_b_proj [heads (nope + rope), q_lora], or q_proj [heads (nope + rope), h] without a query latent;
    kv_a_proj_with_mqa [kv_lora + rope, h] with kv_a_layernorm [kv_lora]; kv_b_proj [heads (nope + v), kv_lora];
    o_proj [h, heads v]; no biases."""
    mla, h, heads = lang.multi_latent_attention, lang.hidden_size, lang.num_attention_heads
    q_width = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    if mla.q_lora_rank is None:
        query = linear_parameters(h, q_width, bias=False)
    else:
        query = (linear_parameters(h, mla.q_lora_rank, bias=False) + mla.q_lora_rank
                 + linear_parameters(mla.q_lora_rank, q_width, bias=False))
    key_value = (linear_parameters(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False) + mla.kv_lora_rank
                 + linear_parameters(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False))
    return query + key_value + linear_parameters(heads * mla.v_head_dim, h, bias=False)


def full_attention_parameters(lang: LanguageConfig) -> int:
    """GQA attention: q, k, v (optional biases), o (no bias), optional per-head q/k RMSNorms. With
    ``attention_output_gate`` q_proj also yields each head's gate: q_proj [2 heads head_dim, h]."""
    h, channels = lang.hidden_size, head_dim(lang)
    q_width, kv_width = lang.num_attention_heads * channels, lang.num_query_groups * channels
    q_proj_width = 2 * q_width if lang.attention_output_gate else q_width
    q_and_kv = (linear_parameters(h, q_proj_width, lang.add_qkv_bias)
                + 2 * linear_parameters(h, kv_width, lang.add_qkv_bias))
    qk_norms = 2 * channels if lang.qk_norm else 0
    return q_and_kv + linear_parameters(q_width, h, bias=False) + qk_norms


def linear_attention_parameters(lang: LanguageConfig) -> int:
    """Gated DeltaNet (transformers' ``Qwen3_5GatedDeltaNet``), with K = key heads x key_head_dim and
    V = value heads x value_head_dim: in_proj_qkv [2K + V, h], in_proj_z [V, h], in_proj_b and
    in_proj_a [value heads, h], the depthwise conv1d [2K + V, 1, conv_kernel] (no bias), dt_bias and
    A_log [value heads], the gated RMSNorm [value_head_dim] and out_proj [h, V]; no biases."""
    shape, h = lang.linear_attention, lang.hidden_size
    key_width = shape.num_key_heads * shape.key_head_dim
    value_width = shape.num_value_heads * shape.value_head_dim
    conv_channels = 2 * key_width + value_width  # q, k, v
    in_proj = linear_parameters(h, conv_channels + value_width + 2 * shape.num_value_heads, bias=False)
    per_value_head = 2 * shape.num_value_heads  # dt_bias, A_log
    return (in_proj + conv_channels * shape.conv_kernel + per_value_head + shape.value_head_dim
            + linear_parameters(value_width, h, bias=False))


def token_mixer_parameters(lang: LanguageConfig, layer_type: str) -> int:
    if layer_type == FULL_ATTENTION:
        return latent_attention_parameters(lang) if lang.multi_latent_attention else full_attention_parameters(lang)
    if layer_type == LINEAR_ATTENTION:
        return linear_attention_parameters(lang)
    raise ValueError(f"model.language.layer_types holds {layer_type!r}; expected {FULL_ATTENTION} or {LINEAR_ATTENTION}")


def language_layer_parameters(lang: LanguageConfig, *, active: bool = False,
                              layer_type: str = FULL_ATTENTION, sparse: bool = True) -> int:
    """One decoder layer: 2 RMSNorms, its token mixer (``layer_type``: GQA or multi-latent attention, or
    Gated DeltaNet), SwiGLU MLP or (``sparse``) routed experts (``mlp_parameters``)."""
    return (2 * lang.hidden_size + token_mixer_parameters(lang, layer_type)
            + mlp_parameters(lang, active=active, sparse=sparse))


def decoder_layers_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """Every decoder layer, each counted by its type (``flops.decoder_layer_types``) and MLP (dense or sparse)."""
    counts = Counter(zip(decoder_layer_types(lang), sparse_layers(lang)))
    return sum(count * language_layer_parameters(lang, active=active, layer_type=kind, sparse=sparse)
               for (kind, sparse), count in counts.items())


def language_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """Embedding, every layer, the final norm, and the output layer unless tied. ``active``: the
    parameters one token runs through (a dense model's are all of them; the embedding counts)."""
    embedding = lang.vocab_size * lang.hidden_size
    output_layer = 0 if lang.tie_word_embeddings else embedding
    layers = decoder_layers_parameters(lang, active=active)
    return embedding + layers + lang.hidden_size + output_layer + lang.mtp_num_layers * mtp_layer_parameters(
        lang, active=active)


def mtp_layer_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """One multi-token-prediction layer: the embedding's and the hidden state's RMSNorms, their projection
    [h, 2h], a decoder layer (sparse where the model has experts) and the head's RMSNorm; the embedding and
    the head are the model's own."""
    h = lang.hidden_size
    return 3 * h + 2 * h * h + language_layer_parameters(lang, active=active)


def model_parameters(model_cfg: ModelConfig, vision_model: int = 0, projector: int = 0) -> dict[str, int]:
    """A model's counts, the encoder's given (0 for a text-only model): {"vision_model", "projector",
    "language_model", "total", "active", "routed_experts"}; ``active`` is what one token runs through
    (the encoder whole, the router's top-k experts of each MoE layer; every parameter of a dense
    model); ``routed_experts``: the experts of every MoE layer (0 if dense)."""
    lang = model_cfg.language
    encoder = vision_model + projector
    language_model = language_parameters(lang)
    return {"vision_model": vision_model, "projector": projector, "language_model": language_model,
            "total": encoder + language_model, "active": encoder + language_parameters(lang, active=True),
            "routed_experts": (sum(sparse_layers(lang)) + lang.mtp_num_layers) * expert_parameters(lang)}
