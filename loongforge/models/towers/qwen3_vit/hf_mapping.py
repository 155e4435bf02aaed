"""HF weight rows of Qwen3-VL's vision part (the ViT, its merger and DeepStack's mergers), for a
family's weight map (``models.hf.rules``; the family adds the language model's rows and its key
styles).

Layouts that are not a plain copy: the ViT's ``qkv`` [3, heads, hd] -> megatron [heads, 3, hd]
(``FusedHeadQKV``); the patch embedding, HF's Conv3d [hidden, C, T, p, p] as our Linear
[hidden, C*T*p*p]; the pre-norms (LayerNorm, weight and bias): ``norm1`` in our
``linear_qkv.layer_norm_{weight,bias}``, ``norm2`` in ``linear_fc1.layer_norm_{weight,bias}``; the
mergers: ``linear_fc1`` column-parallel (bias split with it), ``linear_fc2`` row-parallel.
"""

from __future__ import annotations

from typing import Optional

from loongforge.config.schema import ModelConfig

from loongforge.models.hf.rules import (
    VISION,
    FusedHeadQKV,
    PatchEmbedding,
    Replicated,
    Rule,
    Split,
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


def tower_rules(vision: Qwen3VisionConfig, hf_prefix: str = "visual.") -> list[Rule]:
    """The tower's, the merger's and DeepStack's mergers' rows (vision TP), under ``hf_prefix`` in the
    HF checkpoint (flat style; the family renames them to its checkpoints' nested names)."""
    conv_shape = (vision.hidden_size, vision.in_channels, vision.temporal_patch_size, vision.patch_size,
                  vision.patch_size)
    rep, col, row = Replicated(), Split(0), Split(1)
    qkv = FusedHeadQKV(vision.num_heads, vision.head_dim)
    vb, vl = hf_prefix + "blocks.{i}.", "vision_model.layers.{i}."
    rules = [
        Rule((hf_prefix + "patch_embed.proj.weight",), "vision_model.patch_embed.proj.weight",
             PatchEmbedding(conv_shape), VISION),
        Rule((hf_prefix + "patch_embed.proj.bias",), "vision_model.patch_embed.proj.bias", rep, VISION),
        Rule((hf_prefix + "pos_embed.weight",), "vision_model.pos_embed.weight", rep, VISION),
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
    rules += _merger_rules(hf_prefix + "merger.", "projector.")
    rules += _merger_rules(hf_prefix + "deepstack_merger_list.{i}.", "deepstack_projectors.{i}.",
                           count=vision.num_deepstack_layers)
    return rules


def part_rules(model_cfg: ModelConfig) -> list[Rule]:
    """``tower_rules`` of the run's tower (``parts.TowerPart.hf_rules``)."""
    return tower_rules(Qwen3VisionConfig.from_model_cfg(model_cfg))


def tower_hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tower's and its mergers' HF tensor names (flat ``visual.*``) -> shape implied by ``model_cfg``."""
    vis, proj = model_cfg.vision, model_cfg.projector
    h, ffn = vis.hidden_size, vis.intermediate_size
    merged, out = h * proj.spatial_merge_size**2, proj.out_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "visual.patch_embed.proj.weight": (h, vis.in_channels, vis.temporal_patch_size, vis.patch_size, vis.patch_size),
        "visual.patch_embed.proj.bias": (h,),
        "visual.pos_embed.weight": (vis.num_position_embeddings, h),
    }
    for i in range(vis.depth):
        b = f"visual.blocks.{i}."
        shapes.update({
            b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "norm2.weight": (h,), b + "norm2.bias": (h,),
            b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
            b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
            b + "mlp.linear_fc1.weight": (ffn, h), b + "mlp.linear_fc1.bias": (ffn,),
            b + "mlp.linear_fc2.weight": (h, ffn), b + "mlp.linear_fc2.bias": (h,),
        })
    # The final merger normalises each patch (width h); DeepStack's normalise the merged unit.
    mergers = [("visual.merger.", h)] + [(f"visual.deepstack_merger_list.{i}.", merged)
                                         for i in range(len(vis.deepstack_layers))]
    for prefix, norm_width in mergers:
        shapes.update({
            prefix + "norm.weight": (norm_width,), prefix + "norm.bias": (norm_width,),
            prefix + "linear_fc1.weight": (merged, merged), prefix + "linear_fc1.bias": (merged,),
            prefix + "linear_fc2.weight": (out, merged), prefix + "linear_fc2.bias": (out,),
        })
    return shapes
