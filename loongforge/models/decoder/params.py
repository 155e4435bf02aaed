"""Decoder parameter counts by arithmetic on the config: no tensors are allocated.

Counts use the true vocabulary (as published), not megatron's TP padding; tied embeddings count once.
"""

from __future__ import annotations

from loongforge.config.schema import LanguageConfig


def head_dim(lang: LanguageConfig) -> int:
    """Channels per attention head: ``model.language.head_dim``, else hidden / heads."""
    return lang.head_dim or lang.hidden_size // lang.num_attention_heads


def linear_parameters(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def language_layer_parameters(lang: LanguageConfig) -> int:
    """One decoder layer: 2 RMSNorms, GQA attention (optional qkv bias and per-head q/k norms, no
    o_proj bias), SwiGLU MLP."""
    h, ffn, channels = lang.hidden_size, lang.ffn_hidden_size, head_dim(lang)
    q_width, kv_width = lang.num_attention_heads * channels, lang.num_query_groups * channels
    norms = 2 * h + (2 * channels if lang.qk_norm else 0)
    q_and_kv = (linear_parameters(h, q_width, lang.add_qkv_bias)
                + 2 * linear_parameters(h, kv_width, lang.add_qkv_bias))
    attention = q_and_kv + linear_parameters(q_width, h, bias=False)
    mlp = 3 * linear_parameters(h, ffn, bias=False)
    return norms + attention + mlp


def language_parameters(lang: LanguageConfig) -> int:
    """Embedding, every layer, the final norm, and the output layer unless tied."""
    embedding = lang.vocab_size * lang.hidden_size
    output_layer = 0 if lang.tie_word_embeddings else embedding
    return embedding + lang.num_layers * language_layer_parameters(lang) + lang.hidden_size + output_layer
