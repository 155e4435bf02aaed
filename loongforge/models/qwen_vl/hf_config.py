"""The ``config.json`` of the Qwen3-VL-style families (Qwen3-VL, Qwen3.5), both ways: what they share.

transformers nests the decoder under ``text_config`` and the tower under ``vision_config``, puts the
vision token ids at the top level, and names a family's classes and model types by one pattern, dense
and MoE alike (``HfNames``). Each family reads and writes its own decoder keys (rotary settings,
hybrid layers, experts) through these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from loongforge.config.errors import InputError
from loongforge.config.schema import LanguageConfig, ModelConfig, ProjectorConfig, TokenIdsConfig, VisionConfig

TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass(frozen=True)
class HfNames:
    """A family's transformers names from its class prefix and model type, e.g. ``Qwen3VL`` and
    ``qwen3_vl``: the architectures ``Qwen3VLForConditionalGeneration``, ``Qwen3VLModel`` and their
    ``Qwen3VLMoe...`` twins; the model types ``qwen3_vl`` and ``qwen3_vl_moe``, whose nested configs
    are ``..._text`` and ``..._vision``."""

    class_prefix: str
    model_type: str

    def architecture(self, moe: bool) -> str:
        return f"{self.class_prefix}{'Moe' if moe else ''}ForConditionalGeneration"

    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(name for moe in (False, True)
                     for name in (self.architecture(moe), f"{self.class_prefix}{'Moe' if moe else ''}Model"))

    def model_types(self, moe: bool) -> tuple[str, str, str]:
        """config.json model_type of (the model, its text_config, its vision_config)."""
        model_type = f"{self.model_type}_moe" if moe else self.model_type
        return model_type, f"{model_type}_text", f"{model_type}_vision"

    def is_moe(self, cfg: Mapping[str, Any]) -> bool:
        return (self.architecture(True) in (cfg.get("architectures") or [])
                or cfg.get("model_type") == self.model_types(True)[0])


def rope_parameters(text: Mapping[str, Any]) -> Mapping[str, Any]:
    """The rotary settings of a ``text_config``: ``rope_parameters`` (older Hub files: ``rope_scaling``)."""
    return text.get("rope_parameters") or text.get("rope_scaling") or {}


def model_config_from_hf(cfg: Mapping[str, Any], where: str, *, family: str, model: str,
                         tower: Callable[[Mapping[str, Any]], tuple[VisionConfig, ProjectorConfig]],
                         experts: Callable[[Mapping[str, Any]], dict[str, Any]],
                         language: Callable[[Mapping[str, Any], bool, dict[str, Any]], LanguageConfig]) -> ModelConfig:
    """``ModelConfig`` from a nested ``config.json``: ``experts(text_config)`` (``{}`` for a dense
    model), the tower's configs from ``tower(vision_config)``, the decoder from ``language(text_config,
    tied, experts)``; a missing key is one InputError naming the file and ``model``."""
    text, vision = cfg.get("text_config") or {}, cfg.get("vision_config") or {}
    try:
        routed = experts(text)
        vision_cfg, projector_cfg = tower(vision)
        tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        defaults = TokenIdsConfig()
        return ModelConfig(
            family=family,
            vision=vision_cfg,
            projector=projector_cfg,
            language=language(text, tied, routed),
            tokens=TokenIdsConfig(**{name: cfg.get(name, getattr(defaults, name)) for name in TOKEN_FIELDS}),
        )
    except KeyError as exc:
        raise InputError(f"{where}: config has no {exc.args[0]!r}; is it a complete {model} config.json?") from None


def language_from_hf(text: Mapping[str, Any], *, tied: bool, rope: tuple[float, list[int]], default_head_dim: int,
                     **fields: Any) -> LanguageConfig:
    """The decoder from a ``text_config``: the keys every family reads (Qwen3's decoder: q/k norms, no
    qkv bias, interleaved M-RoPE of ``rope`` = (theta, sections)); ``fields``, the family's own."""
    heads = text["num_attention_heads"]
    return LanguageConfig(
        num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
        ffn_hidden_size=text["intermediate_size"], num_attention_heads=heads,
        num_query_groups=text.get("num_key_value_heads", heads), vocab_size=text["vocab_size"],
        rms_norm_eps=text.get("rms_norm_eps", 1e-6), rope_theta=rope[0], mrope_section=rope[1],
        mrope_interleaved=True, max_position_embeddings=text.get("max_position_embeddings", 262_144),
        tie_word_embeddings=tied, add_qkv_bias=False, qk_norm=True,
        head_dim=text.get("head_dim", default_head_dim), **fields)


def text_config_to_hf(lang: LanguageConfig, model_type: str, dtype: str) -> dict[str, Any]:
    """The ``text_config`` keys every family writes (its own follow: rotary settings, layers, experts)."""
    return {
        "model_type": model_type, "vocab_size": lang.vocab_size, "hidden_size": lang.hidden_size,
        "intermediate_size": lang.ffn_hidden_size, "num_hidden_layers": lang.num_layers,
        "num_attention_heads": lang.num_attention_heads, "num_key_value_heads": lang.num_query_groups,
        "head_dim": lang.head_dim or lang.hidden_size // lang.num_attention_heads, "hidden_act": "silu",
        "max_position_embeddings": lang.max_position_embeddings, "rms_norm_eps": lang.rms_norm_eps,
        "attention_bias": False, "tie_word_embeddings": lang.tie_word_embeddings, "dtype": dtype,
    }


def nested_hf_config(names: HfNames, model_cfg: ModelConfig, dtype: str, *, text: dict[str, Any],
                    vision: dict[str, Any]) -> dict[str, Any]:
    """The whole ``config.json`` around a family's ``text`` and ``vision`` configs."""
    lang = model_cfg.language
    return {
        "architectures": [names.architecture(lang.moe is not None)],
        "model_type": names.model_types(lang.moe is not None)[0],
        "tie_word_embeddings": lang.tie_word_embeddings,
        "dtype": dtype,
        **{name: getattr(model_cfg.tokens, name) for name in TOKEN_FIELDS},
        "text_config": text,
        "vision_config": vision,
    }
