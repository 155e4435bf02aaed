"""Text-only LLMs' HF ``config.json`` both ways: the text backbone's fields (``decoder.text_config``:
Qwen1.5 / Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE, Qwen2-MoE, Qwen3-Next, Llama 2 / 3.x, DeepSeek; Qwen (1.0)'s own layout:
``qwen1``) at the top level, plus the padding token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loongforge.config.errors import InputError
from loongforge.config.schema import ModelConfig, TokenIdsConfig
from loongforge.models.decoder import text_config
from loongforge.models.decoder.text_config import language_from_hf, language_to_hf
from loongforge.models.llm.hf_mapping import decoder_hf_shapes
from loongforge.models.llm.minimax_m2 import (
    MINIMAX_M2_ARCHITECTURE,
    MINIMAX_M2_MODEL_TYPE,
    is_minimax_m2_config,
    minimax_m2_hf_shapes,
    minimax_m2_language_from_hf,
    minimax_m2_language_to_hf,
)
from loongforge.models.llm.qwen1 import (
    QWEN1_ARCHITECTURE,
    QWEN1_MODEL_TYPE,
    is_qwen1_config,
    qwen1_language_from_hf,
    qwen1_language_to_hf,
    qwen1_hf_shapes,
)

NAME = "llm"
HF_ARCHITECTURES = (*text_config.HF_ARCHITECTURES, QWEN1_ARCHITECTURE, MINIMAX_M2_ARCHITECTURE)
HF_MODEL_TYPES = (*text_config.HF_MODEL_TYPES, QWEN1_MODEL_TYPE, MINIMAX_M2_MODEL_TYPE)
# The architectures read in this folder, not by the shared text backbone: config.json both ways, tensor shapes.
_OWN_READING = {QWEN1_ARCHITECTURE: (qwen1_language_to_hf, qwen1_hf_shapes),
                MINIMAX_M2_ARCHITECTURE: (minimax_m2_language_to_hf, minimax_m2_hf_shapes)}
__all__ = ["HF_ARCHITECTURES", "HF_MODEL_TYPES", "NAME", "expected_hf_shapes", "hf_config_from_model",
           "model_config_from_hf"]


def model_config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    """``ModelConfig`` (no vision tower) from a Qwen2 / Qwen3 / Llama ``config.json``."""
    try:
        if is_qwen1_config(cfg):
            language = qwen1_language_from_hf(cfg, where)
        elif is_minimax_m2_config(cfg):
            language = minimax_m2_language_from_hf(cfg, where)
        else:
            language = language_from_hf(cfg, where)
        return ModelConfig(family=NAME, vision=None, projector=None, language=language,
                           tokens=TokenIdsConfig(pad_token_id=_pad_token_id(cfg)))
    except KeyError as exc:
        raise InputError(f"{where}: config has no {exc.args[0]!r}; is it a complete config.json?") from None


def _pad_token_id(cfg: Mapping[str, Any]) -> int:
    # Padding positions carry no loss; any valid id works. Prefer the model's own.
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = cfg.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0


def hf_config_from_model(model_cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A Hub-style ``config.json`` for ``model_cfg``, written when the source carries none."""
    lang = model_cfg.language
    text = (_OWN_READING[lang.architecture][0] if lang.architecture in _OWN_READING else language_to_hf)(lang)
    return {**text, "pad_token_id": model_cfg.tokens.pad_token_id,
            "torch_dtype": dtype}


def expected_hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    lang = model_cfg.language
    return (_OWN_READING[lang.architecture][1] if lang.architecture in _OWN_READING else decoder_hf_shapes)(lang)
