"""LLaVA-OneVision-1.5's HF ``config.json`` both ways (``LlavaOnevision15ForConditionalGeneration``), and the
HF tensor shapes a config implies.

The file nests RICE-ViT and its merger under ``vision_config`` (older checkpoints name its model_type
``rice_vit``) and the language model, a Qwen3, under ``text_config`` (``decoder.text_config``); the vision
tokens are Qwen-VL's, at the top level. What config.json does not hold is the tower's constant: LayerNorm
blocks with q, k, v biases, one frame a temporal patch, the 2-D rotary base 10000 (``vision_common``), and the
processor's OpenAI-CLIP normalisation (preprocessor_config.json).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loongforge.config.errors import InputError
from loongforge.config.schema import ModelConfig, ProjectorConfig, TokenIdsConfig, VisionConfig
from loongforge.models.decoder.hf_mapping import language_hf_shapes
from loongforge.models.decoder.text_config import language_from_hf, language_to_hf
from loongforge.models.llava_onevision1_5.hf_mapping import LANGUAGE_PREFIX
from loongforge.models.qwen_vl.smart_resize import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from loongforge.models.towers.rice_vit.hf_mapping import hf_shapes as tower_hf_shapes
from loongforge.models.vlm.vision_common import VISION_ROPE_THETA

NAME = "llava_onevision1_5"
HF_ARCHITECTURES = ("LlavaOnevision15ForConditionalGeneration",)
HF_MODEL_TYPES = ("llava_onevision1_5",)
VISION_MODEL_TYPE = "llava_onevision1_5_vision"
_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _vision_from_hf(vision: Mapping[str, Any], where: str) -> tuple[VisionConfig, ProjectorConfig]:
    theta = (vision.get("rope_parameters") or {}).get("rope_theta", VISION_ROPE_THETA)
    if theta != VISION_ROPE_THETA:
        raise InputError(f"{where} vision_config: rope_parameters.rope_theta={theta}; RICE-ViT's 2-D rotary base is "
                         f"{VISION_ROPE_THETA}")
    return VisionConfig(
        arch="rice_vit", depth=vision["depth"], hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"], num_heads=vision["num_heads"],
        in_channels=vision.get("in_channels", 3), patch_size=vision.get("patch_size", 14), temporal_patch_size=1,
        window=None, rms_norm_eps=vision.get("layer_norm_eps", 1e-5), hidden_act=vision.get("hidden_act", "gelu"),
        norm="layer", pixel_mean=list(OPENAI_CLIP_MEAN), pixel_std=list(OPENAI_CLIP_STD),
    ), ProjectorConfig(arch="patch_merger", spatial_merge_size=vision.get("spatial_merge_size", 2), hidden_act="gelu",
                       out_hidden_size=vision["out_hidden_size"])


def model_config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    """``ModelConfig`` from a LLaVA-OneVision-1.5 ``config.json``."""
    try:
        text = cfg["text_config"]
        language = language_from_hf(text, f"{where} text_config")
        vision, projector = _vision_from_hf(cfg["vision_config"], where)
    except KeyError as exc:
        raise InputError(f"{where}: config has no {exc.args[0]!r}; is it a complete LLaVA-OneVision-1.5 "
                         "config.json?") from None
    if cfg.get("tie_word_embeddings") is not None:
        language.tie_word_embeddings = bool(cfg["tie_word_embeddings"])
    defaults = TokenIdsConfig()
    pad = text.get("pad_token_id", cfg.get("pad_token_id"))
    tokens = TokenIdsConfig(**{name: cfg.get(name, getattr(defaults, name)) for name in _TOKENS},
                            pad_token_id=pad if isinstance(pad, int) else defaults.pad_token_id)
    return ModelConfig(family=NAME, vision=vision, projector=projector, language=language, tokens=tokens)


def hf_config_from_model(model_cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A transformers-style ``config.json``, written when the source carries none."""
    vis, proj, lang, tok = model_cfg.vision, model_cfg.projector, model_cfg.language, model_cfg.tokens
    return {
        "architectures": [HF_ARCHITECTURES[0]],
        "model_type": HF_MODEL_TYPES[0],
        **{name: getattr(tok, name) for name in _TOKENS},
        "tie_word_embeddings": lang.tie_word_embeddings,
        "dtype": dtype,
        "text_config": {**language_to_hf(lang), "pad_token_id": tok.pad_token_id, "dtype": dtype},
        "vision_config": {
            "model_type": VISION_MODEL_TYPE, "depth": vis.depth, "hidden_size": vis.hidden_size,
            "intermediate_size": vis.intermediate_size, "num_heads": vis.num_heads, "in_channels": vis.in_channels,
            "patch_size": vis.patch_size, "spatial_merge_size": proj.spatial_merge_size,
            "out_hidden_size": proj.out_hidden_size, "hidden_act": vis.hidden_act, "layer_norm_eps": vis.rms_norm_eps,
            "rope_parameters": {"rope_type": "axial", "rope_theta": VISION_ROPE_THETA},
        },
    }


def expected_hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name (the style written, ``hf_mapping``) -> shape implied by ``model_cfg``."""
    return {**tower_hf_shapes(model_cfg), **language_hf_shapes(model_cfg.language, hf_prefix=LANGUAGE_PREFIX)}
