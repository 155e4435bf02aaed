"""Qwen2.5-VL's HF ``config.json`` both ways, and the HF tensor shapes a config implies.

- ``config.json`` -> ``ModelConfig`` for flat (``rope_theta``, ``rope_scaling``, ``in_chans``) and
  nested (``text_config``, ``rope_parameters``) configs;
- ``ModelConfig`` -> a Hub-style ``config.json``, written when a conversion's source has none;
- the Hub-style tensor names and shapes a config implies, so ``loongforge convert`` checks a
  checkpoint against a config or a preset before anything is written.
"""

from __future__ import annotations

from typing import Any, Mapping

from loongforge.config.errors import InputError
from loongforge.config.schema import (
    LanguageConfig,
    ModelConfig,
    ProjectorConfig,
    TokenIdsConfig,
    VisionConfig,
    WindowAttentionConfig,
)
from loongforge.models.decoder.hf_mapping import language_hf_shapes

NAME = "qwen2_5_vl"
HF_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel")
HF_MODEL_TYPES = ("qwen2_5_vl",)


def _text_section(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    # transformers >= 4.5x nests the decoder under text_config; older Hub configs are flat.
    return cfg.get("text_config") or cfg


def _rope(text: Mapping[str, Any], top: Mapping[str, Any]) -> tuple[float, list[int]]:
    params = text.get("rope_parameters") or top.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or top.get("rope_scaling") or {}
    theta = params.get("rope_theta", text.get("rope_theta", top.get("rope_theta", 1_000_000.0)))
    section = params.get("mrope_section") or scaling.get("mrope_section") or [16, 24, 24]
    return float(theta), list(section)


def model_config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    """``ModelConfig`` from a Qwen2.5-VL ``config.json`` (flat or nested)."""
    text, vision = _text_section(cfg), cfg.get("vision_config") or {}
    try:
        theta, section = _rope(text, cfg)
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        defaults = TokenIdsConfig()
        return ModelConfig(
            family=NAME,
            vision=VisionConfig(
                arch="qwen2_5_vit", depth=vision["depth"], hidden_size=vision["hidden_size"],
                intermediate_size=vision["intermediate_size"], num_heads=vision["num_heads"],
                in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
                patch_size=vision.get("patch_size", vision.get("spatial_patch_size", 14)),
                temporal_patch_size=vision.get("temporal_patch_size", 2),
                window=WindowAttentionConfig(size=vision.get("window_size", 112),
                                             fullatt_block_indexes=list(vision.get("fullatt_block_indexes", []))),
                rms_norm_eps=vision.get("rms_norm_eps", 1e-6), hidden_act=vision.get("hidden_act", "silu"),
            ),
            projector=ProjectorConfig(
                spatial_merge_size=vision.get("spatial_merge_size", 2), out_hidden_size=vision["out_hidden_size"],
            ),
            language=LanguageConfig(
                num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
                ffn_hidden_size=text["intermediate_size"], num_attention_heads=text["num_attention_heads"],
                num_query_groups=text.get("num_key_value_heads", text["num_attention_heads"]),
                vocab_size=text["vocab_size"], rms_norm_eps=text.get("rms_norm_eps", 1e-6),
                rope_theta=theta, mrope_section=section,
                max_position_embeddings=text.get("max_position_embeddings", 128_000),
                tie_word_embeddings=bool(tie),
            ),
            tokens=TokenIdsConfig(**{
                name: cfg.get(name, text.get(name, getattr(defaults, name)))
                for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
            }),
            tokens_per_second=vision.get("tokens_per_second", 2),
        )
    except KeyError as exc:
        raise InputError(f"{where}: config has no {exc.args[0]!r}; is it a complete Qwen2.5-VL config.json?") from None


def hf_config_from_model(model_cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A Hub-style (flat text fields, nested ``vision_config``) ``config.json`` for ``model_cfg``;
    written only when the source carries no ``config.json`` of its own."""
    vis, lang, proj, tok = model_cfg.vision, model_cfg.language, model_cfg.projector, model_cfg.tokens
    return {
        "architectures": [HF_ARCHITECTURES[0]],
        "model_type": HF_MODEL_TYPES[0],
        "hidden_size": lang.hidden_size,
        "intermediate_size": lang.ffn_hidden_size,
        "num_hidden_layers": lang.num_layers,
        "num_attention_heads": lang.num_attention_heads,
        "num_key_value_heads": lang.num_query_groups,
        "vocab_size": lang.vocab_size,
        "rms_norm_eps": lang.rms_norm_eps,
        "max_position_embeddings": lang.max_position_embeddings,
        "rope_theta": lang.rope_theta,
        "rope_scaling": {"type": "mrope", "mrope_section": list(lang.mrope_section)},
        "hidden_act": "silu",
        "tie_word_embeddings": lang.tie_word_embeddings,
        "torch_dtype": dtype,
        "image_token_id": tok.image_token_id,
        "video_token_id": tok.video_token_id,
        "vision_start_token_id": tok.vision_start_token_id,
        "vision_end_token_id": tok.vision_end_token_id,
        "vision_config": {
            "depth": vis.depth, "hidden_size": vis.hidden_size, "intermediate_size": vis.intermediate_size,
            "num_heads": vis.num_heads, "in_channels": vis.in_channels, "patch_size": vis.patch_size,
            "temporal_patch_size": vis.temporal_patch_size, "window_size": vis.window.size,
            "fullatt_block_indexes": list(vis.window.fullatt_block_indexes), "hidden_act": vis.hidden_act,
            "spatial_merge_size": proj.spatial_merge_size, "out_hidden_size": proj.out_hidden_size,
            "tokens_per_second": model_cfg.tokens_per_second,
        },
    }


def expected_hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hub-style HF tensor name -> shape implied by ``model_cfg`` (no ``lm_head`` when tied)."""
    vis, lang, proj = model_cfg.vision, model_cfg.language, model_cfg.projector
    h, ffn, merged = vis.hidden_size, vis.intermediate_size, vis.hidden_size * proj.spatial_merge_size**2
    shapes: dict[str, tuple[int, ...]] = {
        "visual.patch_embed.proj.weight": (h, vis.in_channels, vis.temporal_patch_size, vis.patch_size, vis.patch_size),
        "visual.merger.ln_q.weight": (h,),
        "visual.merger.mlp.0.weight": (merged, merged), "visual.merger.mlp.0.bias": (merged,),
        "visual.merger.mlp.2.weight": (proj.out_hidden_size, merged), "visual.merger.mlp.2.bias": (proj.out_hidden_size,),
    }
    for i in range(vis.depth):
        b = f"visual.blocks.{i}."
        shapes.update({
            b + "norm1.weight": (h,), b + "norm2.weight": (h,),
            b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
            b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
            b + "mlp.gate_proj.weight": (ffn, h), b + "mlp.gate_proj.bias": (ffn,),
            b + "mlp.up_proj.weight": (ffn, h), b + "mlp.up_proj.bias": (ffn,),
            b + "mlp.down_proj.weight": (h, ffn), b + "mlp.down_proj.bias": (h,),
        })
    shapes.update(language_hf_shapes(lang))
    return shapes
