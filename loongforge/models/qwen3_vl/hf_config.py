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
from loongforge.config.schema import (
    LanguageConfig,
    ModelConfig,
    TokenIdsConfig,
)
from loongforge.models.decoder.hf_config import experts_from_hf, experts_to_hf
from loongforge.models.decoder.hf_mapping import language_hf_shapes
from loongforge.models.qwen3_vl.hf_mapping import to_hub_style
from loongforge.models.towers.qwen3_vit.hf_config import tower_from_hf, tower_to_hf
from loongforge.models.towers.qwen3_vit.hf_mapping import tower_hf_shapes

NAME = "qwen3_vl"
_DENSE, _MOE = "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"
HF_ARCHITECTURES = (_DENSE, "Qwen3VLModel", _MOE, "Qwen3VLMoeModel")
HF_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# config.json model_type of (the model, its text_config, its vision_config), dense and MoE.
_MODEL_TYPES = {False: ("qwen3_vl", "qwen3_vl_text", "qwen3_vl_vision"),
                True: ("qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_vl_moe_vision")}
_DEFAULT_MROPE_SECTION = [24, 20, 20]  # transformers' default when a config names none
_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _rope(text: Mapping[str, Any]) -> tuple[float, list[int]]:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = params.get("rope_theta", text.get("rope_theta", 5_000_000.0))
    return float(theta), list(params.get("mrope_section") or _DEFAULT_MROPE_SECTION)


def _is_moe(cfg: Mapping[str, Any]) -> bool:
    return _MOE in (cfg.get("architectures") or []) or cfg.get("model_type") == _MODEL_TYPES[True][0]


def _experts(text: Mapping[str, Any], where: str) -> dict[str, Any]:
    if text.get("norm_topk_prob", True) is not True:
        raise InputError(f"{where}: text_config.norm_topk_prob={text['norm_topk_prob']}: transformers' Qwen3-VL-MoE "
                         f"router always renormalises the top-k probabilities (norm_topk_prob true)")
    return experts_from_hf(text, where, model="Qwen3-VL-MoE", key_prefix="text_config.")


def model_config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    """``ModelConfig`` from a Qwen3-VL or Qwen3-VL-MoE ``config.json``."""
    text, vision = cfg.get("text_config") or {}, cfg.get("vision_config") or {}
    try:
        experts = _experts(text, where) if _is_moe(cfg) else {}
        theta, section = _rope(text)
        heads = text["num_attention_heads"]
        vision_cfg, projector_cfg = tower_from_hf(vision)
        defaults = TokenIdsConfig()
        return ModelConfig(
            family=NAME,
            vision=vision_cfg,
            projector=projector_cfg,
            language=LanguageConfig(
                num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
                ffn_hidden_size=text["intermediate_size"], num_attention_heads=heads,
                num_query_groups=text.get("num_key_value_heads", heads), vocab_size=text["vocab_size"],
                rms_norm_eps=text.get("rms_norm_eps", 1e-6), rope_theta=theta, mrope_section=section,
                mrope_interleaved=True, max_position_embeddings=text.get("max_position_embeddings", 262_144),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                add_qkv_bias=False, qk_norm=True, head_dim=text.get("head_dim", 128), **experts,
            ),
            tokens=TokenIdsConfig(**{name: cfg.get(name, getattr(defaults, name)) for name in _TOKEN_FIELDS}),
        )
    except KeyError as exc:
        raise InputError(f"{where}: config has no {exc.args[0]!r}; is it a complete Qwen3-VL config.json?") from None


def config_problems(model_cfg: ModelConfig) -> list[str]:
    """``ModelFamily.config_problems``: transformers' Qwen3-VL-MoE router always renormalises the top-k
    routing probabilities, so a model that does not could not be exported or checked."""
    language = model_cfg.language
    if language.num_experts and not language.norm_topk_prob:
        return ["model.language.norm_topk_prob=false: Qwen3-VL-MoE always renormalises the top-k routing "
                "probabilities; set norm_topk_prob: true."]
    return []


def hf_config_from_model(model_cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A transformers-style ``config.json``, written when the source carries none."""
    lang, tok = model_cfg.language, model_cfg.tokens
    moe = lang.num_experts > 0
    if moe and not lang.norm_topk_prob:
        raise ValueError("model.language.norm_topk_prob=false has no Qwen3-VL-MoE config.json: transformers' "
                         "router always renormalises the top-k probabilities")
    model_type, text_type, vision_type = _MODEL_TYPES[moe]
    return {
        "architectures": [_MOE if moe else _DENSE],
        "model_type": model_type,
        "tie_word_embeddings": lang.tie_word_embeddings,
        "dtype": dtype,
        **{name: getattr(tok, name) for name in _TOKEN_FIELDS},
        "text_config": {
            "model_type": text_type, "vocab_size": lang.vocab_size, "hidden_size": lang.hidden_size,
            "intermediate_size": lang.ffn_hidden_size, "num_hidden_layers": lang.num_layers,
            "num_attention_heads": lang.num_attention_heads, "num_key_value_heads": lang.num_query_groups,
            "head_dim": lang.head_dim or lang.hidden_size // lang.num_attention_heads, "hidden_act": "silu",
            "max_position_embeddings": lang.max_position_embeddings, "rms_norm_eps": lang.rms_norm_eps,
            "attention_bias": False, "tie_word_embeddings": lang.tie_word_embeddings, "dtype": dtype,
            "rope_parameters": {"rope_type": "default", "rope_theta": lang.rope_theta,
                                "mrope_section": list(lang.mrope_section), "mrope_interleaved": True},
            **(experts_to_hf(lang) if moe else {}),
        },
        "vision_config": tower_to_hf(model_cfg, vision_type),
    }


def expected_hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hub-style HF tensor name (Qwen3-VL's nested names) -> shape implied by ``model_cfg``."""
    shapes = tower_hf_shapes(model_cfg)
    shapes.update(language_hf_shapes(model_cfg.language, fused_experts=True))
    return to_hub_style(shapes)
