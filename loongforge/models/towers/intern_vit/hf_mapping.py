"""HF weight rows of InternVL's vision part (InternViT and the pixel-shuffle projector), in the names of
transformers' ``InternVLForConditionalGeneration`` (the family adds the language model's rows).

Layouts that are not a plain copy: q, k and v are separate in HF and one ``linear_qkv`` per head in
megatron (``GroupedQKV`` with a group per head); the patch embedding is HF's Conv2d [h, C, p, p] as our
Linear [h, C*p*p]; the class token [1, 1, h] and the position table [1, 1 + n, h] are kept as [h] and
[1 + n, h]; the pre-norms (``layernorm_before`` / ``layernorm_after``, and the projector's
``layer_norm``) live in the fused ``layer_norm_{weight,bias}`` of the linear after them; ``lambda_1`` /
``lambda_2`` are the attention's and the MLP's ``layer_scale``.

``hf_shapes``: the HF tensors a config implies, for every published InternViT (InternViT-6B's
RMSNorm blocks and q/k norms too).
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.hf.rules import (
    VISION,
    PatchEmbedding,
    Replicated,
    Reshaped,
    Rule,
    Split,
    ViTBlockNames,
    vit_block_rules,
)
from loongforge.models.towers.intern_vit.config import InternViTConfig


def tower_rules(model_cfg: ModelConfig, hf_prefix: str = "model.vision_tower.",
                projector_prefix: str = "model.multi_modal_projector.") -> list[Rule]:
    """InternViT's rows under ``hf_prefix`` and the projector's under ``projector_prefix`` (vision TP).
    RMSNorm blocks (``model.vision.norm=rms``) have no norm biases; InternViT-6B
    (``model.vision.qkv_bias=false``, ``qk_norm=true``) no q, k, v biases and q/k norms (split over TP
    with the heads)."""
    vis = model_cfg.vision
    qkv_bias, qk_norm = vis.qkv_bias, vis.qk_norm
    h, side = vis.hidden_size, vis.image_size // vis.patch_size
    rep, col, row = Replicated(), Split(0), Split(1)
    emb, vb, vl = hf_prefix + "embeddings.", hf_prefix + "encoder.layer.{i}.", "vision_model.layers.{i}."
    names = ViTBlockNames(norm1="layernorm_before", q_k_v="attention.{x}_proj", out="attention.projection_layer",
                          norm2="layernorm_after", fc1="mlp.fc1", fc2="mlp.fc2")
    proj = "projector.mlp."
    rules = [
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
    if qk_norm:
        rules += [Rule((vb + f"attention.{x}_norm.weight",), vl + f"self_attention.{x}_layernorm.weight", col, VISION)
                  for x in "qk"]
    absent = ([] if vis.norm == "layer" else ["layernorm_before.bias", "layernorm_after.bias"]) + (
        [] if qkv_bias else ["attention.q_proj.bias"])  # the q/k/v bias row is named by its first tensor
    return [rule for rule in rules if not any(rule.hf[0] == vb + name for name in absent)]


def hf_shapes(config: InternViTConfig, text_hidden_size: int, hf_prefix: str = "model.vision_tower.",
              projector_prefix: str = "model.multi_modal_projector.") -> dict[str, tuple[int, ...]]:
    """Every HF tensor of transformers' InternVL vision tower and projector and its shape, as ``config``
    implies them (any published variant: RMSNorm blocks have norm weights only, q/k norms are RMSNorms
    over all heads, q/k/v biases only with ``attention_bias``)."""
    h, ffn, side, p = config.hidden_size, config.intermediate_size, config.patches_per_side, config.patch_size
    emb = hf_prefix + "embeddings."
    shapes = {emb + "cls_token": (1, 1, h), emb + "position_embeddings": (1, 1 + side * side, h),
              emb + "patch_embeddings.projection.weight": (h, config.num_channels, p, p),
              emb + "patch_embeddings.projection.bias": (h,)}
    norm_tensors = ("weight", "bias") if config.norm_type == "layer_norm" else ("weight",)
    for i in range(config.num_hidden_layers):
        block = f"{hf_prefix}encoder.layer.{i}."
        for norm in ("layernorm_before", "layernorm_after"):
            shapes.update({f"{block}{norm}.{t}": (h,) for t in norm_tensors})
        for x in "qkv":
            shapes[f"{block}attention.{x}_proj.weight"] = (h, h)
            if config.attention_bias:
                shapes[f"{block}attention.{x}_proj.bias"] = (h,)
        if config.use_qk_norm:
            shapes.update({f"{block}attention.{x}_norm.weight": (h,) for x in "qk"})
        shapes.update({f"{block}attention.projection_layer.weight": (h, h),
                       f"{block}attention.projection_layer.bias": (h,),
                       f"{block}mlp.fc1.weight": (ffn, h), f"{block}mlp.fc1.bias": (ffn,),
                       f"{block}mlp.fc2.weight": (h, ffn), f"{block}mlp.fc2.bias": (h,),
                       f"{block}lambda_1": (h,), f"{block}lambda_2": (h,)})
    merged = h * config.merge_factor**2
    shapes.update({projector_prefix + "layer_norm.weight": (merged,), projector_prefix + "layer_norm.bias": (merged,),
                   projector_prefix + "linear_1.weight": (text_hidden_size, merged),
                   projector_prefix + "linear_1.bias": (text_hidden_size,),
                   projector_prefix + "linear_2.weight": (text_hidden_size, text_hidden_size),
                   projector_prefix + "linear_2.bias": (text_hidden_size,)})
    return shapes
