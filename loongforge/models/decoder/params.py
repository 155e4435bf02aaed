"""Decoder parameter counts by arithmetic on the config: no tensors are allocated.

Counts use the true vocabulary (as published), not megatron's TP padding; tied embeddings count once.
"""

from __future__ import annotations

from loongforge.config.schema import LanguageConfig, ModelConfig


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


def mlp_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """One layer's SwiGLU MLP; with experts, the router plus every expert (``active``: the router
    plus the ``moe_router_topk`` experts one token runs through)."""
    if not lang.num_experts:
        return 3 * linear_parameters(lang.hidden_size, lang.ffn_hidden_size, bias=False)
    return linear_parameters(lang.hidden_size, lang.num_experts, bias=False) + expert_parameters(lang, active=active)


def language_layer_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """One decoder layer: 2 RMSNorms, GQA attention (optional qkv bias and per-head q/k norms, no
    o_proj bias), SwiGLU MLP or routed experts (``mlp_parameters``)."""
    h, channels = lang.hidden_size, head_dim(lang)
    q_width, kv_width = lang.num_attention_heads * channels, lang.num_query_groups * channels
    norms = 2 * h + (2 * channels if lang.qk_norm else 0)
    q_and_kv = (linear_parameters(h, q_width, lang.add_qkv_bias)
                + 2 * linear_parameters(h, kv_width, lang.add_qkv_bias))
    attention = q_and_kv + linear_parameters(q_width, h, bias=False)
    return norms + attention + mlp_parameters(lang, active=active)


def language_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """Embedding, every layer, the final norm, and the output layer unless tied. ``active``: the
    parameters one token runs through (a dense model's are all of them; the embedding counts)."""
    embedding = lang.vocab_size * lang.hidden_size
    output_layer = 0 if lang.tie_word_embeddings else embedding
    layers = lang.num_layers * language_layer_parameters(lang, active=active)
    return embedding + layers + lang.hidden_size + output_layer


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
            "routed_experts": lang.num_layers * expert_parameters(lang)}
