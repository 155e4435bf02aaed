"""Weight map between transformers' Qwen3-VL checkpoints and ``Qwen3VLModel``.

One declarative table, ``mapping_rules(model_cfg, vision)``: each ``Rule`` pairs HF key(s) with one
of our keys and a ``Transform`` (``loongforge.models.hf_rules``) that knows both directions. The
language rows are the shared decoder's (``decoder.hf_mapping.language_rules``: Qwen3 q/k norms, no
qkv bias); the vision rows are below. ``loongforge.models.hf_weights`` walks it.

HF keys come in two styles: Qwen3-VL's own, which its Hub files and transformers 5's state dict and
``save_pretrained`` share (``model.visual.*``, ``model.language_model.*``, ``lm_head``), and the flat
names of Qwen2.5-VL's era (``visual.*``, ``model.layers.*``, ``model.embed_tokens``), which
transformers 5 does not load into Qwen3-VL. Both are read (``to_hub_style``); Qwen3-VL's own is the
style of the rules and the one written. The rows below and the shared decoder's are built flat and
renamed once (``_nested``).

Layouts that are not a plain copy:
- vision ``qkv`` [3, heads, hd] -> megatron [heads, 3, hd] (``FusedHeadQKV``);
- patch embedding: HF's Conv3d weight [hidden, C, T, p, p] is our Linear [hidden, C*T*p*p];
- vision pre-norms (LayerNorm, weight and bias): ``norm1`` lives in our
  ``linear_qkv.layer_norm_{weight,bias}``, ``norm2`` in ``linear_fc1.layer_norm_{weight,bias}``;
- mergers: ``linear_fc1`` column-parallel (bias split with it), ``linear_fc2`` row-parallel;
- Qwen3-VL-MoE's experts: ``mlp.experts.gate_up_proj`` / ``down_proj`` hold a layer's experts
  [E, ...], each expert a megatron ``local_experts.{e}`` pair (``hf_rules.FusedExperts``; the Hub's
  files have the two trailing axes swapped relative to transformers 5, and both are read).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import language_rules
from loongforge.models.hf_rules import (
    VISION,
    FusedHeadQKV,
    PatchEmbedding,
    Replicated,
    Rule,
    Split,
    Tensor,
    rename_prefixes,
)
from loongforge.models.towers.qwen3_vit.vision_facts import Qwen3VisionConfig


def _merger_rules(hf: str, ours: str, count: Optional[int] = None) -> list[Rule]:
    """One merger's rows; ``count``: how many mergers ``{i}`` in the names runs over."""
    rep, col, row = Replicated(), Split(0), Split(1)
    return [
        Rule((hf + "norm.weight",), ours + "norm.weight", rep, VISION, count=count),
        Rule((hf + "norm.bias",), ours + "norm.bias", rep, VISION, count=count),
        Rule((hf + "linear_fc1.weight",), ours + "mlp.linear_fc1.weight", col, VISION, count=count),
        Rule((hf + "linear_fc1.bias",), ours + "mlp.linear_fc1.bias", col, VISION, count=count),
        Rule((hf + "linear_fc2.weight",), ours + "mlp.linear_fc2.weight", row, VISION, count=count),
        Rule((hf + "linear_fc2.bias",), ours + "mlp.linear_fc2.bias", rep, VISION, count=count),
    ]


def mapping_rules(model_cfg: ModelConfig, vision: Optional[Qwen3VisionConfig] = None) -> list[Rule]:
    """The rows; ``vision`` defaults to the facts in ``model_cfg`` (so this can be a family's
    ``hf_rules(model_cfg)`` once the schema has the Qwen3-VL vision fields)."""
    vision = vision or Qwen3VisionConfig.from_model_cfg(model_cfg)
    conv_shape = (vision.hidden_size, vision.in_channels, vision.temporal_patch_size, vision.patch_size,
                  vision.patch_size)
    rep, col, row = Replicated(), Split(0), Split(1)
    qkv = FusedHeadQKV(vision.num_heads, vision.head_dim)
    vb, vl = "visual.blocks.{i}.", "vision_model.layers.{i}."
    rules = [
        Rule(("visual.patch_embed.proj.weight",), "vision_model.patch_embed.proj.weight",
             PatchEmbedding(conv_shape), VISION),
        Rule(("visual.patch_embed.proj.bias",), "vision_model.patch_embed.proj.bias", rep, VISION),
        Rule(("visual.pos_embed.weight",), "vision_model.pos_embed.weight", rep, VISION),
        Rule((vb + "norm1.weight",), vl + "self_attention.linear_qkv.layer_norm_weight", rep, VISION),
        Rule((vb + "norm1.bias",), vl + "self_attention.linear_qkv.layer_norm_bias", rep, VISION),
        Rule((vb + "attn.qkv.weight",), vl + "self_attention.linear_qkv.weight", qkv, VISION),
        Rule((vb + "attn.qkv.bias",), vl + "self_attention.linear_qkv.bias", qkv, VISION),
        Rule((vb + "attn.proj.weight",), vl + "self_attention.linear_proj.weight", row, VISION),
        Rule((vb + "attn.proj.bias",), vl + "self_attention.linear_proj.bias", rep, VISION),
        Rule((vb + "norm2.weight",), vl + "mlp.linear_fc1.layer_norm_weight", rep, VISION),
        Rule((vb + "norm2.bias",), vl + "mlp.linear_fc1.layer_norm_bias", rep, VISION),
        Rule((vb + "mlp.linear_fc1.weight",), vl + "mlp.linear_fc1.weight", col, VISION),
        Rule((vb + "mlp.linear_fc1.bias",), vl + "mlp.linear_fc1.bias", col, VISION),
        Rule((vb + "mlp.linear_fc2.weight",), vl + "mlp.linear_fc2.weight", row, VISION),
        Rule((vb + "mlp.linear_fc2.bias",), vl + "mlp.linear_fc2.bias", rep, VISION),
    ]
    rules += _merger_rules("visual.merger.", "projector.")
    rules += _merger_rules("visual.deepstack_merger_list.{i}.", "deepstack_projectors.{i}.",
                           count=vision.num_deepstack_layers)
    # Qwen3-VL-MoE's experts: one gate_up_proj and one down_proj per layer, every expert in each.
    rules += language_rules(model_cfg.language, fused_experts=True)
    return [_nested(rule) for rule in rules]


# Key styles: flat names -> Qwen3-VL's nested ones (the rules' style); nested names stay as they are.
_FLAT_TO_NESTED = (("model.visual.", "model.visual."), ("model.language_model.", "model.language_model."),
                   ("visual.", "model.visual."), ("model.", "model.language_model."))


def to_hub_style(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return rename_prefixes(hf_state, _FLAT_TO_NESTED)


def _nested_key(key: str) -> str:
    return next(iter(rename_prefixes({key: None}, _FLAT_TO_NESTED)))


def _nested(rule: Rule) -> Rule:
    fallback = None if rule.fallback_hf is None else _nested_key(rule.fallback_hf)
    return dataclasses.replace(rule, hf=tuple(_nested_key(pattern) for pattern in rule.hf), fallback_hf=fallback)
