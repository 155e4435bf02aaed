"""The decoder's rows of a family's HF weight map (``loongforge.models.hf_rules``).

Qwen2, Qwen3 and Llama name their decoder tensors alike in transformers (``model.layers.{i}.*``,
``model.embed_tokens``, ``model.norm``, ``lm_head``); a family adds its own rows (vision tower,
merger) in front of these. Which optional tensors exist follows the config: q/k/v biases
(``add_qkv_bias``), per-head q/k norms (``qk_norm``), ``lm_head`` (untied embeddings).
"""

from __future__ import annotations

from loongforge.config.schema import LanguageConfig
from loongforge.models.decoder.params import head_dim
from loongforge.models.hf_rules import LANGUAGE, GateUp, GroupedQKV, Replicated, Rule, Split, Vocab


def language_rules(lang: LanguageConfig) -> list[Rule]:
    vocab, rep, row, gate_up = Vocab(lang.vocab_size), Replicated(), Split(1), GateUp()
    qkv = GroupedQKV(lang.num_attention_heads, lang.num_query_groups, head_dim(lang))
    lb, ll = "model.layers.{i}.", "language_model.decoder.layers.{i}."
    rules = [
        Rule(("model.embed_tokens.weight",), "language_model.embedding.word_embeddings.weight", vocab, LANGUAGE),
        Rule((lb + "input_layernorm.weight",), ll + "self_attention.linear_qkv.layer_norm_weight", rep, LANGUAGE),
        Rule(tuple(lb + f"self_attn.{p}_proj.weight" for p in "qkv"), ll + "self_attention.linear_qkv.weight", qkv, LANGUAGE),
    ]
    if lang.add_qkv_bias:
        rules.append(Rule(tuple(lb + f"self_attn.{p}_proj.bias" for p in "qkv"), ll + "self_attention.linear_qkv.bias",
                          qkv, LANGUAGE))
    if lang.qk_norm:
        rules += [Rule((lb + "self_attn.q_norm.weight",), ll + "self_attention.q_layernorm.weight", rep, LANGUAGE),
                  Rule((lb + "self_attn.k_norm.weight",), ll + "self_attention.k_layernorm.weight", rep, LANGUAGE)]
    return rules + [
        Rule((lb + "self_attn.o_proj.weight",), ll + "self_attention.linear_proj.weight", row, LANGUAGE),
        Rule((lb + "post_attention_layernorm.weight",), ll + "mlp.linear_fc1.layer_norm_weight", rep, LANGUAGE),
        Rule((lb + "mlp.gate_proj.weight", lb + "mlp.up_proj.weight"), ll + "mlp.linear_fc1.weight", gate_up, LANGUAGE),
        Rule((lb + "mlp.down_proj.weight",), ll + "mlp.linear_fc2.weight", row, LANGUAGE),
        Rule(("model.norm.weight",), "language_model.decoder.final_layernorm.weight", rep, LANGUAGE),
        Rule(("lm_head.weight",), "language_model.output_layer.weight", vocab, LANGUAGE,
             fallback_hf="model.embed_tokens.weight"),
    ]


def language_hf_shapes(lang: LanguageConfig) -> dict[str, tuple[int, ...]]:
    """Hub-style decoder tensor name -> shape (no ``lm_head`` when the embeddings are tied)."""
    d, ffn, channels = lang.hidden_size, lang.ffn_hidden_size, head_dim(lang)
    q, kv = lang.num_attention_heads * channels, lang.num_query_groups * channels
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (lang.vocab_size, d), "model.norm.weight": (d,)}
    if not lang.tie_word_embeddings:
        shapes["lm_head.weight"] = (lang.vocab_size, d)
    for i in range(lang.num_layers):
        b = f"model.layers.{i}."
        shapes.update({
            b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,),
            b + "self_attn.q_proj.weight": (q, d), b + "self_attn.k_proj.weight": (kv, d),
            b + "self_attn.v_proj.weight": (kv, d), b + "self_attn.o_proj.weight": (d, q),
            b + "mlp.gate_proj.weight": (ffn, d), b + "mlp.up_proj.weight": (ffn, d),
            b + "mlp.down_proj.weight": (d, ffn),
        })
        if lang.add_qkv_bias:
            shapes.update({b + "self_attn.q_proj.bias": (q,), b + "self_attn.k_proj.bias": (kv,),
                           b + "self_attn.v_proj.bias": (kv,)})
        if lang.qk_norm:
            shapes.update({b + "self_attn.q_norm.weight": (channels,), b + "self_attn.k_norm.weight": (channels,)})
    return shapes
