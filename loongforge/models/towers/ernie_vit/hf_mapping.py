"""HF weight rows of ERNIE-4.5-VL's vision part (the ViT and the resampler), for a family's weight map
(``models.hf.rules``; the family adds the language model's rows and its key styles), in the names
``save_pretrained`` writes (``model.vision_model.``, ``model.resampler_model.`` with its MLPs' layers numbered
``0``, ``2``, ``3``: fc1, fc2, the norm).

Layouts that are not a plain copy: the ViT's fused ``qkv`` (HF ``[3, heads, hd]``, megatron ``[heads, 3,
hd]``); the pre-norms (LayerNorm weight and bias) in our fused ``layer_norm_{weight,bias}`` names. The
resampler's linears are column- then row-parallel (vision TP), its norms and last linear replicated.
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.hf.rules import VISION, FusedHeadQKV, Replicated, Rule, Split


def tower_rules(model_cfg: ModelConfig, hf_prefix: str = "model.vision_model.",
                resampler_prefix: str = "model.resampler_model.") -> list[Rule]:
    vis = model_cfg.vision
    rep, col, row = Replicated(), Split(0), Split(1)
    qkv = FusedHeadQKV(vis.num_heads, vis.hidden_size // vis.num_heads)
    vb, vl = hf_prefix + "blocks.{i}.", "vision_model.layers.{i}."
    rules = [Rule((hf_prefix + "patch_embed.proj.weight",), "vision_model.patch_embed.proj.weight", rep, VISION)]
    for p in ("weight", "bias"):
        rules += [
            Rule((vb + f"norm1.{p}",), vl + f"self_attention.linear_qkv.layer_norm_{p}", rep, VISION),
            Rule((vb + f"attn.qkv.{p}",), vl + f"self_attention.linear_qkv.{p}", qkv, VISION),
            Rule((vb + f"attn.proj.{p}",), vl + f"self_attention.linear_proj.{p}", row if p == "weight" else rep, VISION),
            Rule((vb + f"norm2.{p}",), vl + f"mlp.linear_fc1.layer_norm_{p}", rep, VISION),
            Rule((vb + f"mlp.fc1.{p}",), vl + f"mlp.linear_fc1.{p}", col, VISION),
            Rule((vb + f"mlp.fc2.{p}",), vl + f"mlp.linear_fc2.{p}", row if p == "weight" else rep, VISION),
            Rule((hf_prefix + f"ln.{p}",), f"vision_model.ln.{p}", rep, VISION),
        ]
        for stage in ("spatial", "temporal"):
            hs, ms = resampler_prefix + f"{stage}_linear.", f"projector.{stage}_linear."
            rules += [Rule((hs + f"0.{p}",), ms + f"linear_fc1.{p}", col, VISION),
                      Rule((hs + f"2.{p}",), ms + f"linear_fc2.{p}", row if p == "weight" else rep, VISION),
                      Rule((hs + f"3.{p}",), f"projector.{stage}_norm.{p}", rep, VISION)]
        rules.append(Rule((resampler_prefix + f"mlp.{p}",), f"projector.mlp.{p}", rep, VISION))
    rules.append(Rule((resampler_prefix + "after_norm.weight",), "projector.after_norm.weight", rep, VISION))
    return rules


def hf_shapes(model_cfg: ModelConfig, hf_prefix: str = "model.vision_model.",
              resampler_prefix: str = "model.resampler_model.") -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the ViT and the resampler and its shape, as ``model_cfg`` implies them."""
    vis, out = model_cfg.vision, model_cfg.projector.out_hidden_size
    h, ffn = vis.hidden_size, vis.intermediate_size
    width = h * model_cfg.projector.spatial_merge_size**2
    shapes = {hf_prefix + "patch_embed.proj.weight": (h, vis.in_channels * vis.patch_size**2),
              hf_prefix + "ln.weight": (h,), hf_prefix + "ln.bias": (h,)}
    for i in range(vis.depth):
        b = f"{hf_prefix}blocks.{i}."
        shapes.update({b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "norm2.weight": (h,), b + "norm2.bias": (h,),
                       b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
                       b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
                       b + "mlp.fc1.weight": (ffn, h), b + "mlp.fc1.bias": (ffn,),
                       b + "mlp.fc2.weight": (h, ffn), b + "mlp.fc2.bias": (h,)})
    for stage, fan_in in (("spatial", width), ("temporal", 2 * width)):
        s = f"{resampler_prefix}{stage}_linear."
        shapes.update({s + "0.weight": (width, fan_in), s + "0.bias": (width,), s + "2.weight": (width, width),
                       s + "2.bias": (width,), s + "3.weight": (width,), s + "3.bias": (width,)})
    shapes.update({resampler_prefix + "mlp.weight": (out, width), resampler_prefix + "mlp.bias": (out,),
                   resampler_prefix + "after_norm.weight": (out,)})
    return shapes
