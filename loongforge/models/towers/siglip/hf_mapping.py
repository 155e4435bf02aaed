"""HF weight rows of SigLIP and the MLP projector, by default in the names of transformers 5's LLaVA-style
state dicts (``model.vision_tower.*``, ``model.multi_modal_projector.*``; a family adds its own rows and
the key styles of Hub checkpoints).

Layouts that are not a plain copy: q, k and v are separate in HF and one ``linear_qkv`` per head in
megatron (``GroupedQKV`` with a group per head); the patch embedding is HF's Conv2d [h, C, p, p] as our
Linear [h, C*p*p]; ``layer_norm1`` / ``layer_norm2`` live in the fused ``layer_norm_{weight,bias}`` of
the linear after them. SigLIP's ``post_layernorm`` is carried, never run (``vision.py``).
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.hf.rules import (
    VISION,
    PatchEmbedding,
    Replicated,
    Rule,
    Split,
    ViTBlockNames,
    vit_block_rules,
)


def tower_rules(model_cfg: ModelConfig, hf_prefix: str = "model.vision_tower.",
                projector_prefix: str = "model.multi_modal_projector.") -> list[Rule]:
    """SigLIP's rows under ``hf_prefix`` and the projector's under ``projector_prefix`` (vision TP)."""
    vis = model_cfg.vision
    h, rep, col, row = vis.hidden_size, Replicated(), Split(0), Split(1)
    emb = hf_prefix + "embeddings."
    names = ViTBlockNames(norm1="layer_norm1", q_k_v="self_attn.{x}_proj", out="self_attn.out_proj",
                          norm2="layer_norm2", fc1="mlp.fc1", fc2="mlp.fc2")
    return [
        Rule((emb + "patch_embedding.weight",), "vision_model.patch_embed.proj.weight",
             PatchEmbedding((h, vis.in_channels, vis.patch_size, vis.patch_size)), VISION),
        Rule((emb + "patch_embedding.bias",), "vision_model.patch_embed.proj.bias", rep, VISION),
        Rule((emb + "position_embedding.weight",), "vision_model.pos_embed.weight", rep, VISION),
        *vit_block_rules(hf_prefix + "encoder.layers.{i}.", "vision_model.layers.{i}.", names, vis.num_heads,
                         h // vis.num_heads),
        Rule((projector_prefix + "linear_1.weight",), "projector.mlp.linear_fc1.weight", col, VISION),
        Rule((projector_prefix + "linear_1.bias",), "projector.mlp.linear_fc1.bias", col, VISION),
        Rule((projector_prefix + "linear_2.weight",), "projector.mlp.linear_fc2.weight", row, VISION),
        Rule((projector_prefix + "linear_2.bias",), "projector.mlp.linear_fc2.bias", rep, VISION),
        # Carried, never run (``vision.py``).
        Rule((hf_prefix + "post_layernorm.weight",), "vision_model.post_layernorm.weight", rep, VISION),
        Rule((hf_prefix + "post_layernorm.bias",), "vision_model.post_layernorm.bias", rep, VISION),
    ]


def hf_shapes(model_cfg: ModelConfig, hf_prefix: str = "model.vision_tower.",
              projector_prefix: str = "model.multi_modal_projector.") -> dict[str, tuple[int, ...]]:
    """Every HF tensor of SigLIP (without a pooling head) and the projector, and its shape, as
    ``model_cfg`` implies them."""
    vis, out = model_cfg.vision, model_cfg.projector.out_hidden_size
    h, ffn, side = vis.hidden_size, vis.intermediate_size, vis.image_size // vis.patch_size
    emb = hf_prefix + "embeddings."
    shapes = {emb + "patch_embedding.weight": (h, vis.in_channels, vis.patch_size, vis.patch_size),
              emb + "patch_embedding.bias": (h,), emb + "position_embedding.weight": (side * side, h),
              hf_prefix + "post_layernorm.weight": (h,), hf_prefix + "post_layernorm.bias": (h,)}
    for i in range(vis.depth):
        block = f"{hf_prefix}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            shapes.update({f"{block}{norm}.weight": (h,), f"{block}{norm}.bias": (h,)})
        for x in ("q", "k", "v", "out"):
            shapes.update({f"{block}self_attn.{x}_proj.weight": (h, h), f"{block}self_attn.{x}_proj.bias": (h,)})
        shapes.update({f"{block}mlp.fc1.weight": (ffn, h), f"{block}mlp.fc1.bias": (ffn,),
                       f"{block}mlp.fc2.weight": (h, ffn), f"{block}mlp.fc2.bias": (h,)})
    shapes.update({projector_prefix + "linear_1.weight": (out, h), projector_prefix + "linear_1.bias": (out,),
                   projector_prefix + "linear_2.weight": (out, out), projector_prefix + "linear_2.bias": (out,)})
    return shapes
