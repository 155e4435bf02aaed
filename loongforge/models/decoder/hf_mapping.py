"""The decoder's rows of a family's HF weight map (``loongforge.models.hf.rules``).

Qwen2, Qwen3 and Llama name their decoder tensors alike in transformers (``model.layers.{i}.*``,
``model.embed_tokens``, ``model.norm``, ``lm_head``); a family adds its own rows (vision tower,
merger) in front of these. Which optional tensors exist follows the config: q/k/v biases
(``add_qkv_bias``), per-head q/k norms (``qk_norm``), ``lm_head`` (untied embeddings), and routed
experts in place of the MLP (``moe``, Qwen3-MoE).

Experts come in two HF layouts, chosen by the family (``fused_experts``):
- per expert (Qwen3-MoE's Hub files): one tensor per expert and projection
  (``mlp.experts.{e}.gate_proj.weight``), which transformers 5 fuses into ``experts.gate_up_proj``
  [E, 2*ffn, h] and ``experts.down_proj`` [E, h, ffn] when it loads; ``hub_experts`` splits those
  fused tensors (a transformers 5 ``state_dict()``) back into the Hub layout;
- fused (Qwen3-VL-MoE, whose Hub files are fused too): ``experts.gate_up_proj`` and
  ``experts.down_proj`` per layer, read in either orientation (``hf_rules.FusedExperts``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from loongforge.config.schema import LanguageConfig
from loongforge.models.decoder.layer_costs import head_dim
from loongforge.models.hf.rules import (
    LANGUAGE,
    Copies,
    FusedExperts,
    GatedGroupedQKV,
    GateUp,
    GroupedQKV,
    GroupedRows,
    Replicated,
    Rule,
    Split,
    Transposed,
    Vocab,
)


def language_rules(lang: LanguageConfig, *, fused_experts: bool = False, hf_prefix: str = "model.",
                   fused_delta_projections: bool = False) -> list[Rule]:
    """The decoder's rows; ``fused_experts``: the routed experts' HF tensors hold every expert of a
    layer (Qwen3-VL-MoE), else one tensor per expert (Qwen3-MoE). ``hf_prefix``: where the HF
    checkpoint keeps the decoder (``model.``; ``model.language_model.`` in compositions such as
    InternVL's, whose HF class nests it); ``lm_head`` is always at the top. A hybrid decoder
    (``layer_types``) has attention rows for its full-attention layers and Gated DeltaNet rows for its
    linear-attention layers (``Rule.layers``); ``fused_delta_projections``: Gated DeltaNet's input projection in
    Qwen3-Next's two tensors (``in_proj_qkvz``, ``in_proj_ba``), else Qwen3.5's four."""
    vocab, rep = Vocab(lang.vocab_size), Replicated()
    lb, ll = hf_prefix + "layers.{i}.", "language_model.decoder.layers.{i}."
    full, linear = _layers_of_kind(lang, "full_attention"), _layers_of_kind(lang, "linear_attention")
    mtp_layers = [f"{hf_prefix}layers.{lang.num_layers + k}." for k in range(lang.mtp_num_layers)]
    embedding = (hf_prefix + "embed_tokens.weight", *(layer + "embed_tokens.weight" for layer in mtp_layers))
    head = ("lm_head.weight", *(layer + "shared_head.head.weight" for layer in mtp_layers))
    rules = [Rule(embedding, "language_model.embedding.word_embeddings.weight", _copies(vocab, embedding), LANGUAGE)]
    if lang.sliding_window is not None:
        rules += _sliding_window_rules(lang, lb, ll)
    else:
        rules += _mla_rules(lang, lb, ll) if lang.multi_latent_attention else _attention_rules(lang, lb, ll, full)
    if linear:
        rules += _linear_attention_rules(lang, lb, ll, linear, fused_delta_projections)
    dense, sparse = _layers_by_mlp(lang)
    if sparse != ():
        rules += [dataclasses.replace(rule, layers=sparse) for rule in _moe_rules(lang, lb, ll, fused_experts)]
    if dense != ():
        rules += [dataclasses.replace(rule, layers=dense) for rule in _dense_mlp_rules(lb, ll)]
    return rules + _mtp_rules(lang, hf_prefix) + [
        Rule((hf_prefix + "norm.weight",), "language_model.decoder.final_layernorm.weight", rep, LANGUAGE),
        Rule(head, "language_model.output_layer.weight", _copies(vocab, head), LANGUAGE,
             fallback_hf=hf_prefix + "embed_tokens.weight"),
    ]


def _copies(transform, keys: tuple[str, ...]):
    return transform if len(keys) == 1 else Copies(transform, len(keys))


def _mtp_rules(lang: LanguageConfig, hf_prefix: str) -> list[Rule]:
    """DeepSeek-V3's multi-token-prediction layers, as its checkpoint stores them: after the decoder's layers
    (``layers.{num_layers + k}.``), the norms of the embedding and of the hidden state (``enorm``, ``hnorm``),
    their projection (``eh_proj`` [h, 2h], embedding columns first), a decoder layer (sparse where the model
    has experts) and the head's norm (``shared_head.norm``); the embedding's and the head's copies are the
    model's own (``Copies``)."""
    rep, rules = Replicated(), []
    sparse = lang.moe is not None
    for k in range(lang.mtp_num_layers):
        hb, mb = f"{hf_prefix}layers.{lang.num_layers + k}.", f"language_model.mtp.layers.{k}."
        lb, ll = hb, mb + "transformer_layer."
        rules += [Rule((hb + "enorm.weight",), mb + "enorm.weight", rep, LANGUAGE),
                  Rule((hb + "hnorm.weight",), mb + "hnorm.weight", rep, LANGUAGE),
                  Rule((hb + "eh_proj.weight",), mb + "eh_proj.weight", Split(0), LANGUAGE),
                  Rule((hb + "shared_head.norm.weight",), mb + "final_layernorm.weight", rep, LANGUAGE)]
        rules += _mla_rules(lang, lb, ll) if lang.multi_latent_attention else _attention_rules(lang, lb, ll, None)
        rules += _moe_rules(lang, lb, ll, fused_experts=False) if sparse else _dense_mlp_rules(lb, ll)
    return rules


def _moe_rules(lang: LanguageConfig, lb: str, ll: str, fused_experts: bool) -> list[Rule]:
    """A sparse layer's MLP rows: its norm (a module of its own: the router and the experts share its output),
    the router (and DeepSeek-V3's expert bias), the routed experts and the shared expert, if any."""
    rep = Replicated()
    if lang.moe.vision_ffn_hidden_size:
        return _modality_moe_rules(lang, lb, ll)
    rules = [Rule((lb + "post_attention_layernorm.weight",), ll + "pre_mlp_layernorm.weight", rep, LANGUAGE),
             Rule((lb + "mlp.gate.weight",), ll + "mlp.router.weight", rep, LANGUAGE)]
    if lang.moe.router_bias_update_rate > 0:
        # DeepSeek-V3's expert bias (fp32, a buffer in both): it moves every step and is trained state.
        rules.append(Rule((lb + "mlp.gate.e_score_correction_bias",), ll + "mlp.router.expert_bias", rep, LANGUAGE))
    rules += _fused_expert_rules(lang, lb, ll) if fused_experts else _expert_rules(lb, ll)
    if lang.moe.shared_expert_ffn_hidden_size is not None:
        rules += _shared_expert_rules(lb, ll, gated=lang.moe.shared_expert_gate)
    return rules


def _modality_moe_rules(lang: LanguageConfig, lb: str, ll: str) -> list[Rule]:
    """A modality-isolated sparse layer (``decoder.modality_moe``) as ERNIE-4.5-VL's checkpoints store it: one
    expert sequence, the text set's experts then the vision set's (``mlp.experts.{e}``, ``Rule.expert_offset``),
    each router's weight transposed ([hidden, experts]: ``gate.weight`` the text set's, ``gate.weight_1`` the
    vision set's), both routers' biases one [2, experts] tensor, and the ungated shared experts."""
    rep = Replicated()
    rules = [Rule((lb + "post_attention_layernorm.weight",), ll + "pre_mlp_layernorm.weight", rep, LANGUAGE),
             Rule((lb + "mlp.gate.weight",), ll + "mlp.text_moe.router.weight", Transposed(), LANGUAGE),
             Rule((lb + "mlp.gate.weight_1",), ll + "mlp.vision_moe.router.weight", Transposed(), LANGUAGE),
             Rule((lb + "mlp.moe_statics.e_score_correction_bias",), ll + "mlp.expert_bias", rep, LANGUAGE)]
    he = lb + "mlp.experts.{e}."
    for kind, offset in (("text_moe", 0), ("vision_moe", lang.moe.num_experts)):
        le = f"{ll}mlp.{kind}.experts.local_experts.{{e}}."
        rules += [Rule((he + "gate_proj.weight", he + "up_proj.weight"), le + "linear_fc1.weight", GateUp(), LANGUAGE,
                       expert_offset=offset),
                  Rule((he + "down_proj.weight",), le + "linear_fc2.weight", Split(1), LANGUAGE, expert_offset=offset)]
    return rules + _shared_expert_rules(lb, ll, gated=False)


def _dense_mlp_rules(lb: str, ll: str) -> list[Rule]:
    """A dense layer's SwiGLU MLP rows, its pre-norm fused into ``linear_fc1``."""
    return [Rule((lb + "post_attention_layernorm.weight",), ll + "mlp.linear_fc1.layer_norm_weight", Replicated(),
                 LANGUAGE),
            Rule((lb + "mlp.gate_proj.weight", lb + "mlp.up_proj.weight"), ll + "mlp.linear_fc1.weight", GateUp(),
                 LANGUAGE),
            Rule((lb + "mlp.down_proj.weight",), ll + "mlp.linear_fc2.weight", Split(1), LANGUAGE)]


def _layers_by_mlp(lang: LanguageConfig) -> tuple[Optional[tuple[int, ...]], Optional[tuple[int, ...]]]:
    """(dense-MLP layers, MoE layers) as ``Rule.layers`` (None: every layer; (): none): a model with experts
    keeps the dense MLP in its first ``moe.first_dense_layers`` (DeepSeek's first_k_dense_replace)."""
    if lang.moe is None:
        return None, ()
    if not lang.moe.first_dense_layers:
        return (), None
    first = lang.moe.first_dense_layers
    return tuple(range(first)), tuple(range(first, lang.num_layers))


def _mla_rules(lang: LanguageConfig, lb: str, ll: str) -> list[Rule]:
    """Multi-latent attention (``layer_specs.mla_layer_spec``): the down-projections column-parallel (each
    rank a slice of the latent's rows, gathered in the forward), the latents' RMSNorms in the
    up-projections after them, every head's rows [no-position channels, rotary or value channels] as
    transformers lays them out."""
    rep, column, hb, mb = Replicated(), Split(0), lb + "self_attn.", ll + "self_attention."
    rules = [Rule((lb + "input_layernorm.weight",), ll + "input_layernorm.weight", rep, LANGUAGE)]
    if lang.multi_latent_attention.q_lora_rank is None:
        rules.append(Rule((hb + "q_proj.weight",), mb + "linear_q_proj.weight", column, LANGUAGE))
    else:
        # Under sparse attention the indexer reads the normed latent too: its norm is a module of its own.
        q_norm = "q_layernorm.weight" if lang.sparse_attention else "linear_q_up_proj.layer_norm_weight"
        rules += [Rule((hb + "q_a_proj.weight",), mb + "linear_q_down_proj.weight", column, LANGUAGE),
                  Rule((hb + "q_a_layernorm.weight",), mb + q_norm, rep, LANGUAGE),
                  Rule((hb + "q_b_proj.weight",), mb + "linear_q_up_proj.weight", column, LANGUAGE)]
    if lang.sparse_attention:
        rules += _indexer_rules(hb + "indexer.", mb + "indexer.")
    return rules + [
        Rule((hb + "kv_a_proj_with_mqa.weight",), mb + "linear_kv_down_proj.weight", column, LANGUAGE),
        Rule((hb + "kv_a_layernorm.weight",), mb + "linear_kv_up_proj.layer_norm_weight", rep, LANGUAGE),
        Rule((hb + "kv_b_proj.weight",), mb + "linear_kv_up_proj.weight", column, LANGUAGE),
        Rule((hb + "o_proj.weight",), mb + "linear_proj.weight", Split(1), LANGUAGE),
    ]


def _indexer_rules(hb: str, mb: str) -> list[Rule]:
    """DeepSeek Sparse Attention's lightning indexer (``decoder.sparse_attention``), whole on every TP rank."""
    rep = Replicated()
    return [Rule((hb + name,), mb + ours, rep, LANGUAGE) for name, ours in (
        ("wq_b.weight", "linear_wq_b.weight"), ("wk.weight", "linear_wk.weight"), ("k_norm.weight", "k_norm.weight"),
        ("k_norm.bias", "k_norm.bias"), ("weights_proj.weight", "linear_weights_proj.weight"))]


def _layers_of_kind(lang: LanguageConfig, kind: str) -> Optional[tuple[int, ...]]:
    """The layers of ``kind`` in a hybrid decoder (``Rule.layers``); None: every layer (not hybrid, and
    ``kind`` full attention); () where none is of that kind."""
    if not lang.layer_types:
        return None if kind == "full_attention" else ()
    return tuple(i for i, layer_kind in enumerate(lang.layer_types) if layer_kind == kind)


def _attention_rules(lang: LanguageConfig, lb: str, ll: str, layers: Optional[tuple[int, ...]]) -> list[Rule]:
    if layers == ():
        return []
    rep, channels = Replicated(), head_dim(lang)
    heads, groups = lang.num_attention_heads, lang.num_query_groups
    qkv = (GatedGroupedQKV if lang.attention_output_gate else GroupedQKV)(heads, groups, channels)
    rules = [
        Rule((lb + "input_layernorm.weight",), ll + "self_attention.linear_qkv.layer_norm_weight", rep, LANGUAGE),
        Rule(tuple(lb + f"self_attn.{p}_proj.weight" for p in "qkv"), ll + "self_attention.linear_qkv.weight", qkv,
             LANGUAGE),
    ]
    if lang.add_qkv_bias:
        rules.append(Rule(tuple(lb + f"self_attn.{p}_proj.bias" for p in "qkv"), ll + "self_attention.linear_qkv.bias",
                          qkv, LANGUAGE))
    if lang.qk_norm:
        # per head: one weight every rank holds; over all heads (per_layer): a weight per channel, split by head
        norm = Split(0) if lang.qk_norm_type == "per_layer" else rep
        rules += [Rule((lb + "self_attn.q_norm.weight",), ll + "self_attention.q_layernorm.weight", norm, LANGUAGE),
                  Rule((lb + "self_attn.k_norm.weight",), ll + "self_attention.k_layernorm.weight", norm, LANGUAGE)]
    rules.append(Rule((lb + "self_attn.o_proj.weight",), ll + "self_attention.linear_proj.weight", Split(1), LANGUAGE))
    return [dataclasses.replace(rule, layers=layers) for rule in rules]


def _sliding_window_rules(lang: LanguageConfig, lb: str, ll: str) -> list[Rule]:
    """MiMo-V2-Flash's attention (``decoder.sliding_attention``), per layer kind (its key/value heads): q/k/v grouped
    by key/value head (``GroupedRows``: each group's queries, key and value), the output projection, and in the
    sliding layers the sink logits (the Hub's ``attention_sink_bias``, transformers' ``sinks``), split over TP with
    the heads. The kinds' projections share their names, not their shapes: each rule holds its kind's layers."""
    window, rules, channels = lang.sliding_window, [], head_dim(lang)
    for kind, groups in (("full_attention", lang.num_query_groups), ("sliding_attention", window.num_query_groups)):
        layers = _layers_of_kind(lang, kind)
        if not layers:
            continue
        qkv = GroupedRows(groups, ((lang.num_attention_heads * channels,), (groups * channels,),
                                   (groups * window.v_head_dim,)))
        kind_rules = [
            Rule((lb + "input_layernorm.weight",), ll + "self_attention.linear_qkv.layer_norm_weight", Replicated(),
                 LANGUAGE),
            Rule(tuple(lb + f"self_attn.{p}_proj.weight" for p in "qkv"), ll + "self_attention.linear_qkv.weight", qkv,
                 LANGUAGE),
            Rule((lb + "self_attn.o_proj.weight",), ll + "self_attention.linear_proj.weight", Split(1), LANGUAGE)]
        if kind == "sliding_attention" and window.sinks:
            kind_rules.append(Rule((lb + "self_attn.attention_sink_bias",), ll + "self_attention.core_attention.sinks",
                                   Split(0), LANGUAGE))
        rules += [dataclasses.replace(rule, layers=layers) for rule in kind_rules]
    return rules


def _sliding_window_shapes(lang: LanguageConfig, b: str, sliding: bool) -> dict[str, tuple[int, ...]]:
    window, d, channels = lang.sliding_window, lang.hidden_size, head_dim(lang)
    groups = window.num_query_groups if sliding else lang.num_query_groups
    shapes = {b + "q_proj.weight": (lang.num_attention_heads * channels, d), b + "k_proj.weight": (groups * channels, d),
              b + "v_proj.weight": (groups * window.v_head_dim, d),
              b + "o_proj.weight": (d, lang.num_attention_heads * window.v_head_dim)}
    if sliding and window.sinks:
        shapes[b + "attention_sink_bias"] = (lang.num_attention_heads,)
    return shapes


def _delta_projections(lang: LanguageConfig, fused: bool) -> tuple[tuple[str, ...], GroupedRows]:
    """transformers' input projections of a Gated DeltaNet layer and how they lay out as the key-head-grouped
    ``in_proj`` (per key head: its q, k, then its value heads' v, z, b, a). Qwen3.5 keeps q/k/v, z, b and a
    apart, each in head order (``GroupedRows`` cuts each into the key heads' blocks); Qwen3-Next fuses them into
    two tensors already grouped by key head ([q, k, v, z] and [b, a] of each), so each is one segment."""
    shape = lang.linear_attention
    q_k, v = shape.num_key_heads * shape.key_head_dim, shape.num_value_heads * shape.value_head_dim
    heads = shape.num_value_heads
    if fused:
        return ("qkvz", "ba"), GroupedRows(shape.num_key_heads, ((2 * q_k + 2 * v,), (2 * heads,)))
    return ("qkv", "z", "b", "a"), GroupedRows(shape.num_key_heads, ((q_k, q_k, v), (v,), (heads,), (heads,)))


def _linear_attention_rules(lang: LanguageConfig, lb: str, ll: str, layers: tuple[int, ...],
                            fused: bool = False) -> list[Rule]:
    """Gated DeltaNet's rows: transformers' projections <-> the key-head-grouped ``in_proj`` and ``conv1d`` of
    ``models.decoder.gated_delta_net`` (``GroupedRows``); ``fused``: Qwen3-Next's two input projections."""
    shape = lang.linear_attention
    q_k, v = shape.num_key_heads * shape.key_head_dim, shape.num_value_heads * shape.value_head_dim
    hb, mb = lb + "linear_attn.", ll + "self_attention."
    names, projection = _delta_projections(lang, fused)
    rules = [
        Rule((lb + "input_layernorm.weight",), mb + "in_proj.layer_norm_weight", Replicated(), LANGUAGE),
        Rule(tuple(hb + f"in_proj_{p}.weight" for p in names), mb + "in_proj.weight", projection, LANGUAGE),
        Rule((hb + "conv1d.weight",), mb + "conv1d.weight", GroupedRows(shape.num_key_heads, ((q_k, q_k, v),)),
             LANGUAGE),
        Rule((hb + "A_log",), mb + "A_log", Split(0), LANGUAGE),
        Rule((hb + "dt_bias",), mb + "dt_bias", Split(0), LANGUAGE),
        Rule((hb + "norm.weight",), mb + "out_norm.weight", Replicated(), LANGUAGE),
        Rule((hb + "out_proj.weight",), mb + "out_proj.weight", Split(1), LANGUAGE),
    ]
    return [dataclasses.replace(rule, layers=layers) for rule in rules]


def _expert_rules(lb: str, ll: str) -> list[Rule]:
    le, he = ll + "mlp.experts.local_experts.{e}.", lb + "mlp.experts.{e}."
    return [Rule((he + "gate_proj.weight", he + "up_proj.weight"), le + "linear_fc1.weight", GateUp(), LANGUAGE),
            Rule((he + "down_proj.weight",), le + "linear_fc2.weight", Split(1), LANGUAGE)]


def _shared_expert_rules(lb: str, ll: str, *, gated: bool) -> list[Rule]:
    """The shared expert (a SwiGLU MLP), megatron's ``SharedExpertMLP``: Qwen3.5-MoE's ``shared_expert`` with
    its gate, or DeepSeek's ``shared_experts`` (ungated; its experts are one MLP of their summed width)."""
    hs, ms = lb + ("mlp.shared_expert." if gated else "mlp.shared_experts."), ll + "mlp.shared_experts."
    rules = [Rule((hs + "gate_proj.weight", hs + "up_proj.weight"), ms + "linear_fc1.weight", GateUp(), LANGUAGE),
             Rule((hs + "down_proj.weight",), ms + "linear_fc2.weight", Split(1), LANGUAGE)]
    if gated:
        rules.append(Rule((lb + "mlp.shared_expert_gate.weight",), ms + "gate_weight", Replicated(), LANGUAGE))
    return rules


def _fused_expert_rules(lang: LanguageConfig, lb: str, ll: str) -> list[Rule]:
    experts, d, ffn = lang.moe.num_experts, lang.hidden_size, lang.moe.ffn_hidden_size
    le = ll + "mlp.experts.local_experts.{e}."
    gate_up = FusedExperts(GateUp(), experts, (2 * ffn, d), parts=2)
    down = FusedExperts(Split(1), experts, (d, ffn), parts=1)
    return [Rule((lb + "mlp.experts.gate_up_proj",), le + "linear_fc1.weight", gate_up, LANGUAGE),
            Rule((lb + "mlp.experts.down_proj",), le + "linear_fc2.weight", down, LANGUAGE)]


def language_hf_shapes(lang: LanguageConfig, *, fused_experts: bool = False, hf_prefix: str = "model.",
                       fused_delta_projections: bool = False) -> dict[str, tuple[int, ...]]:
    """Hub-style decoder tensor name -> shape (no ``lm_head`` when the embeddings are tied);
    ``hf_prefix`` and ``fused_delta_projections`` as ``language_rules``'."""
    d, channels = lang.hidden_size, head_dim(lang)
    q, kv = lang.num_attention_heads * channels, lang.num_query_groups * channels
    shapes: dict[str, tuple[int, ...]] = {hf_prefix + "embed_tokens.weight": (lang.vocab_size, d),
                                          hf_prefix + "norm.weight": (d,)}
    if not lang.tie_word_embeddings:
        shapes["lm_head.weight"] = (lang.vocab_size, d)
    dense, _ = _layers_by_mlp(lang)
    for k in range(lang.mtp_num_layers):  # multi-token prediction's layers, after the decoder's
        b = f"{hf_prefix}layers.{lang.num_layers + k}."
        shapes.update({b + "enorm.weight": (d,), b + "hnorm.weight": (d,), b + "eh_proj.weight": (d, 2 * d),
                       b + "shared_head.norm.weight": (d,), b + "embed_tokens.weight": (lang.vocab_size, d),
                       b + "shared_head.head.weight": (lang.vocab_size, d),
                       b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,)})
        shapes.update(_mlp_shapes(lang, b, fused_experts, dense=lang.moe is None))
        shapes.update(_mla_shapes(lang, b + "self_attn.") if lang.multi_latent_attention else {})
    for i in range(lang.num_layers):
        b = f"{hf_prefix}layers.{i}."
        shapes.update({b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,)})
        shapes.update(_mlp_shapes(lang, b, fused_experts, dense=dense is None or i in dense))
        if lang.multi_latent_attention:
            shapes.update(_mla_shapes(lang, b + "self_attn."))
            continue
        if lang.sliding_window is not None:
            shapes.update(_sliding_window_shapes(lang, b + "self_attn.", lang.layer_types[i] == "sliding_attention"))
            continue
        if lang.layer_types and lang.layer_types[i] == "linear_attention":
            shapes.update(_linear_attention_shapes(lang, b + "linear_attn.", fused_delta_projections))
            continue
        q_out = 2 * q if lang.attention_output_gate else q  # each head's query, then its gate
        shapes.update({
            b + "self_attn.q_proj.weight": (q_out, d), b + "self_attn.k_proj.weight": (kv, d),
            b + "self_attn.v_proj.weight": (kv, d), b + "self_attn.o_proj.weight": (d, q),
        })
        if lang.add_qkv_bias:
            shapes.update({b + "self_attn.q_proj.bias": (q_out,), b + "self_attn.k_proj.bias": (kv,),
                           b + "self_attn.v_proj.bias": (kv,)})
        if lang.qk_norm:
            whole = lang.qk_norm_type == "per_layer"
            shapes.update({b + "self_attn.q_norm.weight": (q if whole else channels,),
                           b + "self_attn.k_norm.weight": (kv if whole else channels,)})
    return shapes


def _linear_attention_shapes(lang: LanguageConfig, b: str, fused: bool) -> dict[str, tuple[int, ...]]:
    shape, d = lang.linear_attention, lang.hidden_size
    q_k, v = shape.num_key_heads * shape.key_head_dim, shape.num_value_heads * shape.value_head_dim
    names, projection = _delta_projections(lang, fused)
    rows = [sum(sizes) for sizes in projection.segments]
    return {**{f"{b}in_proj_{name}.weight": (count, d) for name, count in zip(names, rows)},
            b + "conv1d.weight": (2 * q_k + v, 1, shape.conv_kernel), b + "A_log": (shape.num_value_heads,),
            b + "dt_bias": (shape.num_value_heads,), b + "norm.weight": (shape.value_head_dim,),
            b + "out_proj.weight": (d, v)}


def _mla_shapes(lang: LanguageConfig, b: str) -> dict[str, tuple[int, ...]]:
    mla, d, heads = lang.multi_latent_attention, lang.hidden_size, lang.num_attention_heads
    q_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    shapes = {b + "kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, d),
              b + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
              b + "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
              b + "o_proj.weight": (d, heads * mla.v_head_dim)}
    if mla.q_lora_rank is None:
        return {**shapes, b + "q_proj.weight": (heads * q_head, d)}
    shapes.update({b + "q_a_proj.weight": (mla.q_lora_rank, d), b + "q_a_layernorm.weight": (mla.q_lora_rank,),
                   b + "q_b_proj.weight": (heads * q_head, mla.q_lora_rank)})
    sparse = lang.sparse_attention
    if sparse is not None:
        index_heads, dim, ib = sparse.index_n_heads, sparse.index_head_dim, b + "indexer."
        shapes.update({ib + "wq_b.weight": (index_heads * dim, mla.q_lora_rank), ib + "wk.weight": (dim, d),
                       ib + "k_norm.weight": (dim,), ib + "k_norm.bias": (dim,),
                       ib + "weights_proj.weight": (index_heads, d)})
    return shapes


def _mlp_shapes(lang: LanguageConfig, b: str, fused_experts: bool, dense: bool) -> dict[str, tuple[int, ...]]:
    d = lang.hidden_size
    if dense:
        ffn = lang.ffn_hidden_size
        return {b + "mlp.gate_proj.weight": (ffn, d), b + "mlp.up_proj.weight": (ffn, d),
                b + "mlp.down_proj.weight": (d, ffn)}
    if lang.moe.vision_ffn_hidden_size:
        return _modality_moe_shapes(lang, b)
    ffn, shapes = lang.moe.ffn_hidden_size, {b + "mlp.gate.weight": (lang.moe.num_experts, d)}
    if lang.moe.router_bias_update_rate > 0:
        shapes[b + "mlp.gate.e_score_correction_bias"] = (lang.moe.num_experts,)
    shared = lang.moe.shared_expert_ffn_hidden_size
    if shared is not None:
        hs = b + ("mlp.shared_expert." if lang.moe.shared_expert_gate else "mlp.shared_experts.")
        shapes.update({hs + "gate_proj.weight": (shared, d), hs + "up_proj.weight": (shared, d),
                       hs + "down_proj.weight": (d, shared)})
        if lang.moe.shared_expert_gate:
            shapes[b + "mlp.shared_expert_gate.weight"] = (1, d)
    if fused_experts:  # transformers 5's layout (``FusedExperts`` reads the Hub's transposed one too)
        return {**shapes, b + "mlp.experts.gate_up_proj": (lang.moe.num_experts, 2 * ffn, d),
                b + "mlp.experts.down_proj": (lang.moe.num_experts, d, ffn)}
    for e in range(lang.moe.num_experts):
        shapes.update({f"{b}mlp.experts.{e}.gate_proj.weight": (ffn, d), f"{b}mlp.experts.{e}.up_proj.weight": (ffn, d),
                       f"{b}mlp.experts.{e}.down_proj.weight": (d, ffn)})
    return shapes


def _modality_moe_shapes(lang: LanguageConfig, b: str) -> dict[str, tuple[int, ...]]:
    d, moe = lang.hidden_size, lang.moe
    shapes = {b + "mlp.gate.weight": (d, moe.num_experts), b + "mlp.gate.weight_1": (d, moe.num_experts),
              b + "mlp.moe_statics.e_score_correction_bias": (2, moe.num_experts)}
    for e in range(2 * moe.num_experts):
        ffn = moe.ffn_hidden_size if e < moe.num_experts else moe.vision_ffn_hidden_size
        shapes.update({f"{b}mlp.experts.{e}.gate_proj.weight": (ffn, d), f"{b}mlp.experts.{e}.up_proj.weight": (ffn, d),
                       f"{b}mlp.experts.{e}.down_proj.weight": (d, ffn)})
    if moe.shared_expert_ffn_hidden_size is not None:
        shared, hs = moe.shared_expert_ffn_hidden_size, b + "mlp.shared_experts."
        shapes.update({hs + "gate_proj.weight": (shared, d), hs + "up_proj.weight": (shared, d),
                       hs + "down_proj.weight": (d, shared)})
    return shapes


_FUSED_GATE_UP, _FUSED_DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def hub_experts(hf_state: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5's fused expert tensors -> one Hub tensor per expert and projection (views,
    no copies); other keys unchanged. ``gate_up_proj`` [E, 2*ffn, h] holds each expert's gate rows,
    then its up rows (transformers chunks the product in two); ``down_proj`` is [E, h, ffn]."""
    out: dict[str, Any] = {}
    for key, value in hf_state.items():
        if key.endswith(_FUSED_GATE_UP):
            prefix = key[: -len(_FUSED_GATE_UP)] + ".mlp.experts."
            for e, (gate, up) in enumerate(tensor.chunk(2, dim=0) for tensor in value):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif key.endswith(_FUSED_DOWN):
            prefix = key[: -len(_FUSED_DOWN)] + ".mlp.experts."
            out.update({f"{prefix}{e}.down_proj.weight": tensor for e, tensor in enumerate(value)})
        else:
            out[key] = value
    return out
