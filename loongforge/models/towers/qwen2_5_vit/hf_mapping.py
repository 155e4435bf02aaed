"""HF weight rows of Qwen2.5-VL's vision part (the ViT and the patch merger), for a family's weight
map (``models.hf.rules``; the family adds the language model's rows and its key styles).

Layouts that are not a plain copy: the ViT's ``qkv`` (HF ``[3, heads, hd]``, megatron
``[heads, 3, hd]``); SwiGLU ``linear_fc1`` (each TP rank ``[gate shard, up shard]``); the patch
embedding (HF's Conv3d [hidden, C, T, p, p] is our Linear [hidden, C*T*p*p]); the pre-norms, in our
fused ``layer_norm_weight`` names.
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.hf.rules import (
    VISION,
    FusedHeadQKV,
    GateUp,
    PatchEmbedding,
    Replicated,
    Rule,
    Split,
)


def tower_rules(model_cfg: ModelConfig, hf_prefix: str = "visual.") -> list[Rule]:
    """The tower's and the merger's rows (vision TP), under ``hf_prefix`` in the HF checkpoint
    (transformers' Qwen2.5-VL: ``visual.``)."""
    vis = model_cfg.vision
    vision_head_dim = vis.hidden_size // vis.num_heads
    conv_shape = (vis.hidden_size, vis.in_channels, vis.temporal_patch_size, vis.patch_size, vis.patch_size)
    rep, col, row, gate_up = Replicated(), Split(0), Split(1), GateUp()
    vqkv = FusedHeadQKV(vis.num_heads, vision_head_dim)

    vb, vl = hf_prefix + "blocks.{i}.", "vision_model.layers.{i}."
    rules = [
        Rule((hf_prefix + "patch_embed.proj.weight",), "vision_model.patch_embed.proj.weight", PatchEmbedding(conv_shape), VISION),
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
        Rule((hf_prefix + "merger.ln_q.weight",), "projector.ln_q.weight", rep, VISION),
        Rule((hf_prefix + "merger.mlp.0.weight",), "projector.mlp.linear_fc1.weight", col, VISION),
        Rule((hf_prefix + "merger.mlp.0.bias",), "projector.mlp.linear_fc1.bias", col, VISION),
        Rule((hf_prefix + "merger.mlp.2.weight",), "projector.mlp.linear_fc2.weight", row, VISION),
        Rule((hf_prefix + "merger.mlp.2.bias",), "projector.mlp.linear_fc2.bias", rep, VISION),
    ]
    return rules
