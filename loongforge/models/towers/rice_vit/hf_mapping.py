"""HF weight rows of RICE-ViT and its patch merger, under the names LLaVA-OneVision-1.5's checkpoints hold
(``visual.*``: ``class_embedding``, ``class_pos_emb``, ``merger.ln_q``, ``merger.mlp.0`` / ``.2``; transformers'
modules call them ``cls_embeddings.*``, ``merger.norm``, ``merger.linear_fc1`` / ``2``, and its ``save_pretrained``
writes the checkpoint's names back). A family adds the language model's rows and its key styles.

Layouts that are not a plain copy: ``qkv`` [3, heads, hd] -> megatron [heads, 3, hd] (``FusedHeadQKV``); the
patch embedding, HF's Conv2d [h, C, p, p] as our Linear [h, C*p*p]; the class token's angles [1, hd/2] as
[hd/2]; the pre-norms: ``norm1`` in ``linear_qkv.layer_norm_{weight,bias}``, ``norm2`` in
``linear_fc1.layer_norm_{weight,bias}``; the merger: ``mlp.0`` column-parallel (bias split with it), ``mlp.2``
row-parallel.
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.hf.rules import (
    VISION,
    FusedHeadQKV,
    PatchEmbedding,
    Replicated,
    Reshaped,
    Rule,
    Split,
)


def tower_rules(model_cfg: ModelConfig, hf_prefix: str = "visual.") -> list[Rule]:
    """The tower's and the merger's rows (vision TP) under ``hf_prefix``."""
    vis = model_cfg.vision
    h, head_dim = vis.hidden_size, vis.hidden_size // vis.num_heads
    rep, col, row = Replicated(), Split(0), Split(1)
    vb, vl = hf_prefix + "blocks.{i}.", "vision_model.layers.{i}."

    def pair(hf: str, ours: str, weight, bias) -> list[Rule]:
        return [Rule((hf + ".weight",), ours + ".weight", weight, VISION),
                Rule((hf + ".bias",), ours + ".bias", bias, VISION)]

    qkv = FusedHeadQKV(vis.num_heads, head_dim)
    return [
        Rule((hf_prefix + "patch_embed.proj.weight",), "vision_model.patch_embed.proj.weight",
             PatchEmbedding((h, vis.in_channels, vis.patch_size, vis.patch_size)), VISION),
        Rule((hf_prefix + "class_embedding",), "vision_model.class_embedding", rep, VISION),
        Rule((hf_prefix + "class_pos_emb",), "vision_model.class_rotary",
             Reshaped((1, head_dim // 2), (head_dim // 2,)), VISION),
        *pair(hf_prefix + "pre_layernorm", "vision_model.pre_layernorm", rep, rep),
        Rule((vb + "norm1.weight",), vl + "self_attention.linear_qkv.layer_norm_weight", rep, VISION),
        Rule((vb + "norm1.bias",), vl + "self_attention.linear_qkv.layer_norm_bias", rep, VISION),
        *pair(vb + "attn.qkv", vl + "self_attention.linear_qkv", qkv, qkv),
        *pair(vb + "attn.proj", vl + "self_attention.linear_proj", row, rep),
        Rule((vb + "norm2.weight",), vl + "mlp.linear_fc1.layer_norm_weight", rep, VISION),
        Rule((vb + "norm2.bias",), vl + "mlp.linear_fc1.layer_norm_bias", rep, VISION),
        *pair(vb + "mlp.fc1", vl + "mlp.linear_fc1", col, col),
        *pair(vb + "mlp.fc2", vl + "mlp.linear_fc2", row, rep),
        *pair(hf_prefix + "merger.ln_q", "projector.norm", rep, rep),
        *pair(hf_prefix + "merger.mlp.0", "projector.mlp.linear_fc1", col, col),
        *pair(hf_prefix + "merger.mlp.2", "projector.mlp.linear_fc2", row, rep),
    ]


def hf_shapes(model_cfg: ModelConfig, hf_prefix: str = "visual.") -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the tower and the merger under ``hf_prefix``, and its shape, as ``model_cfg`` implies."""
    vis, proj = model_cfg.vision, model_cfg.projector
    h, ffn, head_dim = vis.hidden_size, vis.intermediate_size, vis.hidden_size // vis.num_heads
    merged, out = h * proj.spatial_merge_size**2, proj.out_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        hf_prefix + "patch_embed.proj.weight": (h, vis.in_channels, vis.patch_size, vis.patch_size),
        hf_prefix + "class_embedding": (h,), hf_prefix + "class_pos_emb": (1, head_dim // 2),
        hf_prefix + "pre_layernorm.weight": (h,), hf_prefix + "pre_layernorm.bias": (h,),
    }
    for i in range(vis.depth):
        b = f"{hf_prefix}blocks.{i}."
        shapes.update({
            b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "norm2.weight": (h,), b + "norm2.bias": (h,),
            b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
            b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
            b + "mlp.fc1.weight": (ffn, h), b + "mlp.fc1.bias": (ffn,),
            b + "mlp.fc2.weight": (h, ffn), b + "mlp.fc2.bias": (h,),
        })
    m = hf_prefix + "merger."
    shapes.update({m + "ln_q.weight": (h,), m + "ln_q.bias": (h,), m + "mlp.0.weight": (merged, merged),
                   m + "mlp.0.bias": (merged,), m + "mlp.2.weight": (out, merged), m + "mlp.2.bias": (out,)})
    return shapes
