"""Qwen3-VL's HF ``config.json`` both ways, and the HF tensor shapes a config implies.

transformers nests the decoder under ``text_config`` (Qwen3: q/k norms, no qkv bias, ``head_dim``)
with its rotary settings under ``rope_parameters`` (older Hub files: ``rope_scaling`` and a flat
``rope_theta``), and the ViT under ``vision_config``.

Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``, model_type ``qwen3_vl_moe``) is the same
model with routed experts in every decoder layer: the expert fields sit in ``text_config``
(``models.decoder.hf_config``), and its router always renormalises the top-k probabilities
(transformers' ``Qwen3VLMoeTextTopKRouter`` has no ``norm_topk_prob`` switch).
"""

from __future__ import annotations

from typing import Any, Mapping

from loongforge.config.errors import InputError
from loongforge.config.schema import LanguageConfig, ModelConfig
from loongforge.models.decoder.hf_config import experts_from_hf, experts_to_hf
from loongforge.models.decoder.hf_mapping import language_hf_shapes
from loongforge.models.qwen3_vl.hf_mapping import to_hub_style
from loongforge.models.qwen_vl import hf_config as nested
from loongforge.models.towers.qwen3_vit.hf_config import tower_from_hf, tower_to_hf
from loongforge.models.towers.qwen3_vit.hf_mapping import tower_hf_shapes

NAME = "qwen3_vl"
_NAMES = nested.HfNames(class_prefix="Qwen3VL", model_type="qwen3_vl")
HF_ARCHITECTURES = _NAMES.architectures  # Qwen3VL[Moe]ForConditionalGeneration, Qwen3VL[Moe]Model
HF_MODEL_TYPES = (_NAMES.model_types(False)[0], _NAMES.model_types(True)[0])  # qwen3_vl, qwen3_vl_moe
_DEFAULT_MROPE_SECTION = [24, 20, 20]  # transformers' default when a config names none


def _experts(text: Mapping[str, Any], where: str) -> dict[str, Any]:
    if text.get("norm_topk_prob", True) is not True:
        raise InputError(f"{where}: text_config.norm_topk_prob={text['norm_topk_prob']}: transformers' Qwen3-VL-MoE "
                         f"router always renormalises the top-k probabilities (norm_topk_prob true)")
    return experts_from_hf(text, where, model="Qwen3-VL-MoE", key_prefix="text_config.")


def _rope(text: Mapping[str, Any]) -> tuple[float, list[int]]:
    params = nested.rope_parameters(text)
    theta = params.get("rope_theta", text.get("rope_theta", 5_000_000.0))
    return float(theta), list(params.get("mrope_section") or _DEFAULT_MROPE_SECTION)


def _language(text: Mapping[str, Any], tied: bool, experts: dict[str, Any]) -> LanguageConfig:
    return nested.language_from_hf(text, tied=tied, rope=_rope(text), default_head_dim=128, **experts)


def model_config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    """``ModelConfig`` from a Qwen3-VL or Qwen3-VL-MoE ``config.json``."""
    return nested.model_config_from_hf(
        cfg, where, family=NAME, model="Qwen3-VL", tower=tower_from_hf, language=_language,
        experts=lambda text: _experts(text, where) if _NAMES.is_moe(cfg) else {})


def config_problems(model_cfg: ModelConfig) -> list[str]:
    """``ModelFamily.config_problems``: transformers' Qwen3-VL-MoE router always renormalises the top-k
    routing probabilities, so a model that does not could not be exported or checked."""
    language = model_cfg.language
    if language.moe and not language.moe.norm_topk_prob:
        return ["model.language.moe.norm_topk_prob=false: Qwen3-VL-MoE always renormalises the top-k routing "
                "probabilities; set norm_topk_prob: true."]
    return []


def hf_config_from_model(model_cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A transformers-style ``config.json``, written when the source carries none."""
    lang = model_cfg.language
    moe = lang.moe is not None
    if moe and not lang.moe.norm_topk_prob:
        raise ValueError("model.language.moe.norm_topk_prob=false has no Qwen3-VL-MoE config.json: transformers' "
                         "router always renormalises the top-k probabilities")
    _, text_type, vision_type = _NAMES.model_types(moe)
    text = {**nested.text_config_to_hf(lang, text_type, dtype),
            "rope_parameters": {"rope_type": "default", "rope_theta": lang.rope_theta,
                                "mrope_section": list(lang.mrope_section), "mrope_interleaved": True},
            **(experts_to_hf(lang) if moe else {})}
    return nested.nested_hf_config(_NAMES, model_cfg, dtype, text=text, vision=tower_to_hf(model_cfg, vision_type))


def expected_hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hub-style HF tensor name (Qwen3-VL's nested names) -> shape implied by ``model_cfg``."""
    shapes = tower_hf_shapes(model_cfg)
    shapes.update(language_hf_shapes(model_cfg.language, fused_experts=True))
    return to_hub_style(shapes)
