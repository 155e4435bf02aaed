"""Weight map between transformers' Qwen2.5-VL checkpoints and ``Qwen2_5_VLModel``.

One declarative table, ``mapping_rules(model_cfg)``: each ``Rule`` pairs HF key(s) with one of our
keys and a ``Transform`` (``loongforge.models.hf_rules``) that knows both directions (full HF tensors -> this TP rank's shard, and
all ranks' shards -> full HF tensors). ``loongforge.models.hf_weights`` walks the table.

HF keys come in two styles: the Hub's (``visual.*``, ``model.layers.*``, ``model.embed_tokens``,
``lm_head``) and newer transformers' (``model.visual.*``, ``model.language_model.*``). Both are
read (``to_hub_style``); the Hub style is written. ``{i}`` in a pattern is a layer index; language
layers are global in HF and local to the pipeline stage in megatron (``layer_offset``).

Layouts that are not a plain copy:
- language ``linear_qkv``: megatron groups the query heads of each key/value group with that
  group's k and v: ``[q(g, 0..r-1), k(g), v(g)]`` for g in groups, r = heads/groups; TP splits
  whole groups (or, with fewer groups than TP ranks, equal contiguous slices of that layout).
- vision ``qkv``: HF stores ``[3, heads, hd]``; megatron wants ``[heads, 3, hd]`` (groups = heads).
- ``linear_fc1`` of SwiGLU MLPs: each TP rank holds ``[gate shard, up shard]``.
- column-parallel weights split along dim 0, row-parallel along dim 1 (their bias is whole).
- vocabulary: rows padded to ``padded_vocab_size`` with zeros, then split along dim 0.
- patch embedding: HF's Conv3d weight [hidden, C, T, p, p] is our Linear [hidden, C*T*p*p].
- pre-norms: HF's ``input_layernorm`` / ``norm1`` live in our ``linear_qkv.layer_norm_weight``, and
  ``post_attention_layernorm`` / ``norm2`` in ``linear_fc1.layer_norm_weight`` (the fused names every
  layer backend writes; the older separate names are read too, see ``state_dict_names``).
"""

from __future__ import annotations

from typing import Mapping


from loongforge.config.schema import ModelConfig
from loongforge.models.hf_rules import (  # noqa: F401  (Transform, Vocab: re-exported for callers of this table)
    LANGUAGE,
    VISION,
    FusedHeadQKV,
    GateUp,
    GroupedQKV,
    PatchEmbedding,
    Replicated,
    Rule,
    Split,
    Tensor,
    Transform,
    Vocab,
    rename_prefixes,
)
from loongforge.models.decoder.hf_mapping import language_rules

# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    vis, lang = model_cfg.vision, model_cfg.language
    vision_head_dim = vis.hidden_size // vis.num_heads
    conv_shape = (vis.hidden_size, vis.in_channels, vis.temporal_patch_size, vis.patch_size, vis.patch_size)
    rep, col, row, gate_up = Replicated(), Split(0), Split(1), GateUp()
    vqkv = FusedHeadQKV(vis.num_heads, vision_head_dim)

    vb, vl = "visual.blocks.{i}.", "vision_model.layers.{i}."
    rules = [
        Rule(("visual.patch_embed.proj.weight",), "vision_model.patch_embed.proj.weight", PatchEmbedding(conv_shape), VISION),
        Rule((vb + "norm1.weight",), vl + "self_attention.linear_qkv.layer_norm_weight", rep, VISION),
        Rule((vb + "attn.qkv.weight",), vl + "self_attention.linear_qkv.weight", vqkv, VISION),
        Rule((vb + "attn.qkv.bias",), vl + "self_attention.linear_qkv.bias", vqkv, VISION),
        Rule((vb + "attn.proj.weight",), vl + "self_attention.linear_proj.weight", row, VISION),
        Rule((vb + "attn.proj.bias",), vl + "self_attention.linear_proj.bias", rep, VISION),
        Rule((vb + "norm2.weight",), vl + "mlp.linear_fc1.layer_norm_weight", rep, VISION),
        Rule((vb + "mlp.gate_proj.weight", vb + "mlp.up_proj.weight"), vl + "mlp.linear_fc1.weight", gate_up, VISION),
        Rule((vb + "mlp.gate_proj.bias", vb + "mlp.up_proj.bias"), vl + "mlp.linear_fc1.bias", gate_up, VISION),
        Rule((vb + "mlp.down_proj.weight",), vl + "mlp.linear_fc2.weight", row, VISION),
        Rule((vb + "mlp.down_proj.bias",), vl + "mlp.linear_fc2.bias", rep, VISION),
        Rule(("visual.merger.ln_q.weight",), "projector.ln_q.weight", rep, VISION),
        Rule(("visual.merger.mlp.0.weight",), "projector.mlp.linear_fc1.weight", col, VISION),
        Rule(("visual.merger.mlp.0.bias",), "projector.mlp.linear_fc1.bias", col, VISION),
        Rule(("visual.merger.mlp.2.weight",), "projector.mlp.linear_fc2.weight", row, VISION),
        Rule(("visual.merger.mlp.2.bias",), "projector.mlp.linear_fc2.bias", rep, VISION),
    ]
    return rules + language_rules(lang)


# ---------------------------------------------------------------------------------------------
# Key styles
# ---------------------------------------------------------------------------------------------

_NEW_TO_HUB = (("model.visual.", "visual."), ("model.language_model.", "model."))


def to_hub_style(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename ``model.visual.*`` / ``model.language_model.*`` keys to the Hub's style."""
    return rename_prefixes(hf_state, _NEW_TO_HUB)
