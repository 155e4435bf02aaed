"""Qwen (1.0)'s published checkpoints (``QWenLMHeadModel``, model_type ``qwen``; no transformers class: the Hub
ships its modeling code) read into, and written from, the Qwen2-style decoder: the same layers (RMSNorm, RoPE with
rotated halves, q/k/v biases, no other bias, a SwiGLU MLP) under other names and one fused attention input.

The key layout, per layer ``N`` (Qwen2's names on the right)::

    transformer.wte.weight            model.embed_tokens.weight
    transformer.h.N.ln_1.weight       model.layers.N.input_layernorm.weight
    transformer.h.N.attn.c_attn.*     model.layers.N.self_attn.{q,k,v}_proj.*  (rows [q | k | v], weight and bias)
    transformer.h.N.attn.c_proj.weight  model.layers.N.self_attn.o_proj.weight
    transformer.h.N.ln_2.weight       model.layers.N.post_attention_layernorm.weight
    transformer.h.N.mlp.w2.weight     model.layers.N.mlp.gate_proj.weight
    transformer.h.N.mlp.w1.weight     model.layers.N.mlp.up_proj.weight
    transformer.h.N.mlp.c_proj.weight model.layers.N.mlp.down_proj.weight
    transformer.ln_f.weight           model.norm.weight
    lm_head.weight                    lm_head.weight

Qwen's MLP computes ``c_proj(w1(x) * silu(w2(x)))``: ``w2`` is the gate, ``w1`` the up projection. Its config.json's
``intermediate_size`` is the two projections' rows together (22016 for Qwen-7B: an MLP of width 11008), its head width
``kv_channels``. Every published size has as many key/value heads as query heads (no GQA), which the fused rows assume.
Its ``use_dynamic_ntk`` and ``use_logn_attn`` rescale RoPE and attention only past ``seq_length`` (inference-time
extrapolation): training here is within it, and the config.json written states both false.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loongforge.config.errors import InputError
from loongforge.config.schema import LanguageConfig, ModelConfig
from loongforge.models.decoder.text_config import text_architecture_problems
from loongforge.models.hf.rules import LANGUAGE, FusedHeadQKV, GateUp, Replicated, Rule, Split, Vocab

QWEN1_ARCHITECTURE, QWEN1_MODEL_TYPE = "QWenLMHeadModel", "qwen"


def is_qwen1_config(cfg: Mapping[str, Any]) -> bool:
    """Whether a config.json is Qwen (1.0)'s."""
    return QWEN1_ARCHITECTURE in (cfg.get("architectures") or []) or cfg.get("model_type") == QWEN1_MODEL_TYPE


def qwen1_language_from_hf(cfg: Mapping[str, Any], where: str) -> LanguageConfig:
    """The Qwen2-style decoder of a Qwen (1.0) config.json; KeyError for a missing required key."""
    heads, channels, hidden = cfg["num_attention_heads"], cfg["kv_channels"], cfg["hidden_size"]
    if float(cfg.get("rotary_pct", 1.0)) != 1.0:
        raise InputError(f"{where}: rotary_pct={cfg['rotary_pct']}: loongforge's Qwen (1.0) rotates every channel "
                         "of a head (rotary_pct 1.0, as every published size)")
    if cfg["intermediate_size"] % 2:
        raise InputError(f"{where}: intermediate_size={cfg['intermediate_size']} is odd; Qwen (1.0)'s holds w1's "
                         "and w2's rows together (twice the MLP width)")
    return LanguageConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=hidden, ffn_hidden_size=cfg["intermediate_size"] // 2,
        num_attention_heads=heads, num_query_groups=heads, vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-6), rope_theta=float(cfg.get("rotary_emb_base", 10_000.0)),
        mrope_section=[], max_position_embeddings=cfg.get("max_position_embeddings", cfg.get("seq_length", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), add_qkv_bias=True,
        head_dim=channels if channels * heads != hidden else None, architecture=QWEN1_ARCHITECTURE)


def qwen1_language_to_hf(lang: LanguageConfig) -> dict[str, Any]:
    """Qwen (1.0)'s config.json fields of ``lang``."""
    return {"architectures": [QWEN1_ARCHITECTURE], "model_type": QWEN1_MODEL_TYPE, "hidden_size": lang.hidden_size,
            "intermediate_size": 2 * lang.ffn_hidden_size, "num_hidden_layers": lang.num_layers,
            "num_attention_heads": lang.num_attention_heads,
            "kv_channels": lang.head_dim or lang.hidden_size // lang.num_attention_heads,
            "vocab_size": lang.vocab_size, "layer_norm_epsilon": lang.rms_norm_eps,
            "rotary_emb_base": lang.rope_theta, "rotary_pct": 1.0,
            "max_position_embeddings": lang.max_position_embeddings, "seq_length": lang.max_position_embeddings,
            "no_bias": True, "tie_word_embeddings": lang.tie_word_embeddings,
            "use_dynamic_ntk": False, "use_logn_attn": False}


def qwen1_problems(lang: LanguageConfig) -> list[str]:
    """What the fused q/k/v rows and the key layout cannot hold: one line each, naming the key."""
    wrong = []
    if lang.num_query_groups != lang.num_attention_heads:
        wrong.append(f"model.language.num_query_groups={lang.num_query_groups} (Qwen (1.0)'s fused c_attn has a "
                     f"key and value head per query head: {lang.num_attention_heads})")
    if not lang.add_qkv_bias or lang.qk_norm or lang.moe is not None or lang.multi_latent_attention is not None:
        wrong.append("model.language.add_qkv_bias: true, qk_norm: false, moe and multi_latent_attention null "
                     "(Qwen (1.0)'s layers)")
    return [f"model.language.architecture={QWEN1_ARCHITECTURE} needs {item}." for item in wrong]


def architecture_problems(model_cfg: ModelConfig) -> list[str]:
    """``ModelFamily.config_problems`` of the text family: Qwen (1.0)'s, else the stated text architecture's."""
    if model_cfg.language.architecture == QWEN1_ARCHITECTURE:
        return qwen1_problems(model_cfg.language)
    return text_architecture_problems(model_cfg)


def qwen1_rules(lang: LanguageConfig) -> list[Rule]:
    """The weight map of Qwen (1.0)'s key layout (the module docstring's table)."""
    vocab, rep, hb, ll = Vocab(lang.vocab_size), Replicated(), "transformer.h.{i}.", "language_model.decoder.layers.{i}."
    channels = lang.head_dim or lang.hidden_size // lang.num_attention_heads
    qkv = FusedHeadQKV(lang.num_attention_heads, channels)  # per-group [q | k | v] is per-head without GQA
    return [
        Rule(("transformer.wte.weight",), "language_model.embedding.word_embeddings.weight", vocab, LANGUAGE),
        Rule((hb + "ln_1.weight",), ll + "self_attention.linear_qkv.layer_norm_weight", rep, LANGUAGE),
        Rule((hb + "attn.c_attn.weight",), ll + "self_attention.linear_qkv.weight", qkv, LANGUAGE),
        Rule((hb + "attn.c_attn.bias",), ll + "self_attention.linear_qkv.bias", qkv, LANGUAGE),
        Rule((hb + "attn.c_proj.weight",), ll + "self_attention.linear_proj.weight", Split(1), LANGUAGE),
        Rule((hb + "ln_2.weight",), ll + "mlp.linear_fc1.layer_norm_weight", rep, LANGUAGE),
        Rule((hb + "mlp.w2.weight", hb + "mlp.w1.weight"), ll + "mlp.linear_fc1.weight", GateUp(), LANGUAGE),
        Rule((hb + "mlp.c_proj.weight",), ll + "mlp.linear_fc2.weight", Split(1), LANGUAGE),
        Rule(("transformer.ln_f.weight",), "language_model.decoder.final_layernorm.weight", rep, LANGUAGE),
        Rule(("lm_head.weight",), "language_model.output_layer.weight", vocab, LANGUAGE,
             fallback_hf="transformer.wte.weight"),
    ]


def qwen1_hf_shapes(lang: LanguageConfig) -> dict[str, tuple[int, ...]]:
    """Qwen (1.0)'s tensor name -> shape (no ``lm_head`` when the embeddings are tied)."""
    d, ffn = lang.hidden_size, lang.ffn_hidden_size
    fused = 3 * lang.num_attention_heads * (lang.head_dim or d // lang.num_attention_heads)
    shapes = {"transformer.wte.weight": (lang.vocab_size, d), "transformer.ln_f.weight": (d,)}
    for i in range(lang.num_layers):
        b = f"transformer.h.{i}."
        shapes.update({b + "ln_1.weight": (d,), b + "attn.c_attn.weight": (fused, d), b + "attn.c_attn.bias": (fused,),
                       b + "attn.c_proj.weight": (d, fused // 3), b + "ln_2.weight": (d,),
                       b + "mlp.w1.weight": (ffn, d), b + "mlp.w2.weight": (ffn, d), b + "mlp.c_proj.weight": (d, ffn)})
    if not lang.tie_word_embeddings:
        shapes["lm_head.weight"] = (lang.vocab_size, d)
    return shapes
