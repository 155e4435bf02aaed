"""HF weight rows of LLaVA-OneVision's vision part (SigLIP and the MLP projector), in the names of
transformers 5's ``LlavaOnevisionForConditionalGeneration`` state dict (the family adds the language
model's rows and the key styles of Hub checkpoints).

Layouts that are not a plain copy: q, k and v are separate in HF and one ``linear_qkv`` per head in
megatron (``GroupedQKV`` with a group per head); the patch embedding is HF's Conv2d [h, C, p, p] as our
Linear [h, C*p*p]; ``layer_norm1`` / ``layer_norm2`` live in the fused ``layer_norm_{weight,bias}`` of
the linear after them. SigLIP's ``post_layernorm`` has no row: LLaVA-OneVision never runs it.
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.hf_rules import (
    VISION,
    GroupedQKV,
    PatchEmbedding,
    Replicated,
    Rule,
    Split,
)


def tower_rules(model_cfg: ModelConfig, hf_prefix: str = "model.vision_tower.",
                projector_prefix: str = "model.multi_modal_projector.") -> list[Rule]:
    """SigLIP's rows under ``hf_prefix`` and the projector's under ``projector_prefix`` (vision TP)."""
    vis = model_cfg.vision
    h, heads = vis.hidden_size, vis.num_heads
    rep, col, row = Replicated(), Split(0), Split(1)
    qkv = GroupedQKV(heads, heads, h // heads)
    emb, vb, vl = hf_prefix + "embeddings.", hf_prefix + "encoder.layers.{i}.", "vision_model.layers.{i}."
    attention, mlp = vl + "self_attention.", vl + "mlp."
    return [
        Rule((emb + "patch_embedding.weight",), "vision_model.patch_embed.proj.weight",
             PatchEmbedding((h, vis.in_channels, vis.patch_size, vis.patch_size)), VISION),
        Rule((emb + "patch_embedding.bias",), "vision_model.patch_embed.proj.bias", rep, VISION),
        Rule((emb + "position_embedding.weight",), "vision_model.pos_embed.weight", rep, VISION),
        Rule((vb + "layer_norm1.weight",), attention + "linear_qkv.layer_norm_weight", rep, VISION),
        Rule((vb + "layer_norm1.bias",), attention + "linear_qkv.layer_norm_bias", rep, VISION),
        Rule(tuple(vb + f"self_attn.{x}_proj.weight" for x in "qkv"), attention + "linear_qkv.weight", qkv, VISION),
        Rule(tuple(vb + f"self_attn.{x}_proj.bias" for x in "qkv"), attention + "linear_qkv.bias", qkv, VISION),
        Rule((vb + "self_attn.out_proj.weight",), attention + "linear_proj.weight", row, VISION),
        Rule((vb + "self_attn.out_proj.bias",), attention + "linear_proj.bias", rep, VISION),
        Rule((vb + "layer_norm2.weight",), mlp + "linear_fc1.layer_norm_weight", rep, VISION),
        Rule((vb + "layer_norm2.bias",), mlp + "linear_fc1.layer_norm_bias", rep, VISION),
        Rule((vb + "mlp.fc1.weight",), mlp + "linear_fc1.weight", col, VISION),
        Rule((vb + "mlp.fc1.bias",), mlp + "linear_fc1.bias", col, VISION),
        Rule((vb + "mlp.fc2.weight",), mlp + "linear_fc2.weight", row, VISION),
        Rule((vb + "mlp.fc2.bias",), mlp + "linear_fc2.bias", rep, VISION),
        Rule((projector_prefix + "linear_1.weight",), "projector.mlp.linear_fc1.weight", col, VISION),
        Rule((projector_prefix + "linear_1.bias",), "projector.mlp.linear_fc1.bias", col, VISION),
        Rule((projector_prefix + "linear_2.weight",), "projector.mlp.linear_fc2.weight", row, VISION),
        Rule((projector_prefix + "linear_2.bias",), "projector.mlp.linear_fc2.bias", rep, VISION),
    ]
