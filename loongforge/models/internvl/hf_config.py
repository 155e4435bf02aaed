"""InternVL's HF ``config.json`` both ways (``InternVLForConditionalGeneration``), and the HF tensor
shapes a config implies.

The file nests the tower under ``vision_config`` (``towers/intern_vit/config.py`` reads it, with the
composition's ``downsample_ratio``, ``projector_hidden_act`` and ``vision_feature_layer`` from the top
level) and the language model under ``text_config`` (a Qwen3 or Qwen2 config: ``decoder.text_config``).
The image markers are not in config.json: InternVL's tokenizers add ``<img>``, ``</img>`` and
``<IMG_CONTEXT>`` (``image_token_id``) in that order, so the markers are the two ids before it (the
tokenizer is checked against them before training). The processor writes videos as frames of images:
no video token (``model.tokens.video_token_id = -1``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loongforge.config.errors import InputError
from loongforge.config.schema import ModelConfig, TokenIdsConfig
from loongforge.models.decoder.hf_mapping import language_hf_shapes
from loongforge.models.decoder.text_config import language_from_hf, language_to_hf
from loongforge.models.internvl.hf_mapping import LANGUAGE_PREFIX, to_hub_style
from loongforge.models.towers.intern_vit.config import InternViTConfig
from loongforge.models.towers.intern_vit.hf_mapping import hf_shapes as tower_hf_shapes

NAME = "internvl"
HF_ARCHITECTURES = ("InternVLForConditionalGeneration",)
HF_MODEL_TYPES = ("internvl",)
NO_VIDEO_TOKEN = -1  # model.tokens.video_token_id of a family without one: no row holds it


def model_config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    """``ModelConfig`` from an InternVL ``config.json``."""
    try:
        text = cfg["text_config"]
        language = language_from_hf(text, f"{where} text_config")
        tower = InternViTConfig.from_hf(
            cfg["vision_config"], f"{where} vision_config", downsample_ratio=cfg.get("downsample_ratio", 0.5),
            projector_hidden_act=cfg.get("projector_hidden_act", "gelu"),
            vision_feature_layer=cfg.get("vision_feature_layer", -1))
        vision, projector = tower.to_schema(language.hidden_size)
        image = cfg["image_token_id"]
    except KeyError as exc:
        raise InputError(f"{where}: config has no {exc.args[0]!r}; is it a complete InternVL config.json?") from None
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if cfg.get("tie_word_embeddings") is not None:
        language.tie_word_embeddings = bool(cfg["tie_word_embeddings"])
    pad = text.get("pad_token_id", cfg.get("pad_token_id"))
    tokens = TokenIdsConfig(image_token_id=image, video_token_id=NO_VIDEO_TOKEN, vision_start_token_id=image - 2,
                            vision_end_token_id=image - 1,
                            pad_token_id=pad if isinstance(pad, int) else TokenIdsConfig().pad_token_id)
    return ModelConfig(family=NAME, vision=vision, projector=projector, language=language, tokens=tokens)


def hf_config_from_model(model_cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A transformers-style ``config.json``, written when the source carries none."""
    tower = InternViTConfig.from_schema(model_cfg.vision, model_cfg.projector)
    lang = model_cfg.language
    return {
        "architectures": [HF_ARCHITECTURES[0]],
        "model_type": HF_MODEL_TYPES[0],
        "downsample_ratio": tower.downsample_ratio,
        "image_seq_length": tower.tokens_per_tile,
        "image_token_id": model_cfg.tokens.image_token_id,
        "projector_hidden_act": tower.projector_hidden_act,
        "vision_feature_layer": tower.vision_feature_layer,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": lang.tie_word_embeddings,
        "dtype": dtype,
        "text_config": {**language_to_hf(lang), "pad_token_id": model_cfg.tokens.pad_token_id, "dtype": dtype},
        "vision_config": tower.to_hf(),
    }


def expected_hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name (the Hub's style, ``hf_mapping``) -> shape implied by ``model_cfg``."""
    tower = InternViTConfig.from_schema(model_cfg.vision, model_cfg.projector)
    return to_hub_style({**tower_hf_shapes(tower, model_cfg.language.hidden_size),
                         **language_hf_shapes(model_cfg.language, hf_prefix=LANGUAGE_PREFIX)})
