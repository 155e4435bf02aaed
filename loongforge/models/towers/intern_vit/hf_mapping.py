"""HF weight rows of InternVL's vision part (InternViT and the pixel-shuffle projector), in the names of
transformers' ``InternVLForConditionalGeneration`` (the family adds the language model's rows).

Layouts that are not a plain copy: q, k and v are separate in HF and one ``linear_qkv`` per head in
megatron (``GroupedQKV`` with a group per head); the patch embedding is HF's Conv2d [h, C, p, p] as our
Linear [h, C*p*p]; the class token [1, 1, h] and the position table [1, 1 + n, h] are kept as [h] and
[1 + n, h]; the pre-norms (``layernorm_before`` / ``layernorm_after``, and the projector's
``layer_norm``) live in the fused ``layer_norm_{weight,bias}`` of the linear after them; ``lambda_1`` /
``lambda_2`` are the attention's and the MLP's ``layer_scale``.
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.hf_rules import (
    VISION,
    PatchEmbedding,
    Replicated,
    Reshaped,
    Rule,
    Split,
    ViTBlockNames,
    vit_block_rules,
)


def tower_rules(model_cfg: ModelConfig, hf_prefix: str = "model.vision_tower.",
                projector_prefix: str = "model.multi_modal_projector.") -> list[Rule]:
    """InternViT's rows under ``hf_prefix`` and the projector's under ``projector_prefix`` (vision TP)."""
    vis = model_cfg.vision
    h, side = vis.hidden_size, vis.image_size // vis.patch_size
    rep, col, row = Replicated(), Split(0), Split(1)
    emb, vb, vl = hf_prefix + "embeddings.", hf_prefix + "encoder.layer.{i}.", "vision_model.layers.{i}."
    names = ViTBlockNames(norm1="layernorm_before", q_k_v="attention.{x}_proj", out="attention.projection_layer",
                          norm2="layernorm_after", fc1="mlp.fc1", fc2="mlp.fc2")
    proj = "projector.mlp."
    return [
        Rule((emb + "cls_token",), "vision_model.cls_token", Reshaped((1, 1, h), (h,)), VISION),
        Rule((emb + "position_embeddings",), "vision_model.pos_embed",
             Reshaped((1, 1 + side * side, h), (1 + side * side, h)), VISION),
        Rule((emb + "patch_embeddings.projection.weight",), "vision_model.patch_embed.proj.weight",
             PatchEmbedding((h, vis.in_channels, vis.patch_size, vis.patch_size)), VISION),
        Rule((emb + "patch_embeddings.projection.bias",), "vision_model.patch_embed.proj.bias", rep, VISION),
        *vit_block_rules(vb, vl, names, vis.num_heads, h // vis.num_heads),
        Rule((vb + "lambda_1",), vl + "self_attention.layer_scale", rep, VISION),
        Rule((vb + "lambda_2",), vl + "mlp.layer_scale", rep, VISION),
        Rule((projector_prefix + "layer_norm.weight",), proj + "linear_fc1.layer_norm_weight", rep, VISION),
        Rule((projector_prefix + "layer_norm.bias",), proj + "linear_fc1.layer_norm_bias", rep, VISION),
        Rule((projector_prefix + "linear_1.weight",), proj + "linear_fc1.weight", col, VISION),
        Rule((projector_prefix + "linear_1.bias",), proj + "linear_fc1.bias", col, VISION),
        Rule((projector_prefix + "linear_2.weight",), proj + "linear_fc2.weight", row, VISION),
        Rule((projector_prefix + "linear_2.bias",), proj + "linear_fc2.bias", rep, VISION),
    ]
