"""LLaVA-OneVision's HF ``config.json`` both ways (``LlavaOnevisionForConditionalGeneration``), and the
HF tensor shapes a config implies.

The file nests SigLIP under ``vision_config`` and the language model (Qwen2) under ``text_config``
(``decoder.text_config``); the composition's keys sit at the top: the image token
(``image_token_index``), the anyres canvases (``image_grid_pinpoints``) and the crops' worth of features
past which they are pooled (``vision_aspect_ratio="anyres_max_9"``). loongforge builds the published
composition: the last layer's output of every patch (``vision_feature_layer=-1``,
``vision_feature_select_strategy="full"``), a projector with biases, no pooling head.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from loongforge.config.errors import InputError
from loongforge.config.schema import (
    AnyresConfig,
    ModelConfig,
    ProjectorConfig,
    TokenIdsConfig,
    VisionConfig,
)
from loongforge.models.decoder.hf_mapping import language_hf_shapes
from loongforge.models.decoder.text_config import language_from_hf, language_to_hf
from loongforge.models.llava_onevision.anyres import SIGLIP_MEAN, SIGLIP_STD
from loongforge.models.llava_onevision.hf_mapping import LANGUAGE_PREFIX, NEWLINE, to_hub_style
from loongforge.models.towers.siglip.hf_mapping import hf_shapes as tower_hf_shapes

NAME = "llava_onevision"
HF_ARCHITECTURES = ("LlavaOnevisionForConditionalGeneration",)
HF_MODEL_TYPES = ("llava_onevision",)
NO_TOKEN = -1  # model.tokens of a format without vision markers: no row holds it
# What loongforge builds; any other value of these keys is refused in one line.
_FIXED = {"vision_feature_layer": -1, "vision_feature_select_strategy": "full", "multimodal_projector_bias": True}


def _check_fixed(cfg: Mapping[str, Any], where: str) -> None:
    for key, value in _FIXED.items():
        if cfg.get(key, value) != value:
            raise InputError(f"{where}: {key}={cfg[key]!r}: loongforge's LLaVA-OneVision is built with {value!r}")
    if cfg.get("vision_config", {}).get("vision_use_head"):
        raise InputError(f"{where}: vision_config.vision_use_head=true: LLaVA-OneVision runs no pooling head; "
                         "set it to false")


def _max_crops(aspect_ratio: str, where: str) -> int:
    found = re.fullmatch(r"anyres_max_(\d+)", aspect_ratio)
    if found is None:
        raise InputError(f"{where}: vision_aspect_ratio={aspect_ratio!r}: loongforge reads anyres_max_<crops>")
    return int(found.group(1))


def model_config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    """``ModelConfig`` from a LLaVA-OneVision ``config.json``."""
    _check_fixed(cfg, where)
    try:
        text, vision = cfg["text_config"], cfg["vision_config"]
        language = language_from_hf(text, f"{where} text_config")
        tower = VisionConfig(
            arch="siglip", depth=vision["num_hidden_layers"], hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"], num_heads=vision["num_attention_heads"],
            in_channels=vision.get("num_channels", 3), patch_size=vision["patch_size"], temporal_patch_size=1,
            image_size=vision["image_size"], window=None,
            rms_norm_eps=vision.get("layer_norm_eps", 1e-6), hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
            norm="layer", anyres=AnyresConfig(pinpoints=[list(p) for p in cfg["image_grid_pinpoints"]],
                                              max_crops=_max_crops(cfg.get("vision_aspect_ratio", "anyres_max_9"), where)),
            pixel_mean=list(SIGLIP_MEAN), pixel_std=list(SIGLIP_STD))
        image, video = cfg.get("image_token_index", 151646), cfg.get("video_token_index", 151647)
    except KeyError as exc:
        raise InputError(f"{where}: config has no {exc.args[0]!r}; is it a complete LLaVA-OneVision config.json?") from None
    if cfg.get("tie_word_embeddings") is not None:
        language.tie_word_embeddings = bool(cfg["tie_word_embeddings"])
    projector = ProjectorConfig(arch="mlp", spatial_merge_size=1, hidden_act=cfg.get("projector_hidden_act", "gelu"),
                                out_hidden_size=language.hidden_size)
    pad = text.get("pad_token_id", cfg.get("pad_token_id"))
    tokens = TokenIdsConfig(image_token_id=image, video_token_id=video, vision_start_token_id=NO_TOKEN,
                            vision_end_token_id=NO_TOKEN,
                            pad_token_id=pad if isinstance(pad, int) else TokenIdsConfig().pad_token_id)
    return ModelConfig(family=NAME, vision=tower, projector=projector, language=language, tokens=tokens)


def hf_config_from_model(model_cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A transformers-style ``config.json``, written when the source carries none."""
    vis, lang = model_cfg.vision, model_cfg.language
    return {
        "architectures": [HF_ARCHITECTURES[0]],
        "model_type": HF_MODEL_TYPES[0],
        "image_token_index": model_cfg.tokens.image_token_id,
        "video_token_index": model_cfg.tokens.video_token_id,
        "image_grid_pinpoints": [list(p) for p in vis.anyres.pinpoints],
        "vision_aspect_ratio": f"anyres_max_{vis.anyres.max_crops}",
        "projector_hidden_act": model_cfg.projector.hidden_act,
        "image_seq_length": (vis.image_size // vis.patch_size) ** 2,
        **_FIXED,
        "tie_word_embeddings": lang.tie_word_embeddings,
        "dtype": dtype,
        "text_config": {**language_to_hf(lang), "pad_token_id": model_cfg.tokens.pad_token_id, "dtype": dtype},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": vis.hidden_size,
                          "intermediate_size": vis.intermediate_size, "num_hidden_layers": vis.depth,
                          "num_attention_heads": vis.num_heads, "num_channels": vis.in_channels,
                          "image_size": vis.image_size, "patch_size": vis.patch_size,
                          "layer_norm_eps": vis.rms_norm_eps, "hidden_act": vis.hidden_act, "vision_use_head": False},
    }


def expected_hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name (the Hub's style, ``hf_mapping``) -> shape implied by ``model_cfg``."""
    return to_hub_style({**tower_hf_shapes(model_cfg), NEWLINE: (model_cfg.projector.out_hidden_size,),
                         **language_hf_shapes(model_cfg.language, hf_prefix=LANGUAGE_PREFIX)})
