"""A composition has no transformers class: its config.json is never read, and an HF export is refused
in one line naming why (``convert --to hf``, ``checkpoint.save_hf``). Its weight rows (the tower's and the
decoder's, in the parts' HF names) still give the checkpoint's tensors their shapes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loongforge.config.errors import InputError
from loongforge.config.schema import ModelConfig
from loongforge.models import parts
from loongforge.models.decoder.hf_mapping import language_hf_shapes, language_rules
from loongforge.models.decoder.text_config import architecture
from loongforge.models.hf.rules import Rule


def _described(model_cfg: ModelConfig) -> str:
    try:
        language = architecture(model_cfg.language)
    except ValueError:
        language = "its decoder"
    return f"{model_cfg.vision.arch} + {model_cfg.projector.arch} + {language}"


def config_to_hf(model_cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    raise ValueError(f"model.family=composition ({_described(model_cfg)}): no transformers class describes this "
                     "composition, so it has no HF export; keep the loongforge checkpoint (it resumes at any "
                     "layout), or compose a family transformers reads (qwen2_5_vl, qwen3_vl, internvl, llava_onevision)")


def config_from_hf(cfg: Mapping[str, Any], where: str) -> ModelConfig:
    raise InputError(f"{where}: an HF config.json is never a composition (no transformers class describes one)")


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    """The tower's rows and the decoder's, in their parts' HF names (what LoRA targets by)."""
    return parts.tower(model_cfg.vision.arch).hf_rules(model_cfg) + language_rules(model_cfg.language)


def hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The decoder's HF shapes (LoRA's targets); no HF folder of a composition is ever read or written."""
    return language_hf_shapes(model_cfg.language)
