"""Qwen2.5-VL's processor files (``ModelFamily.hf_processor_files``): transformers'
``Qwen2_5_VLProcessor`` with the Qwen2-VL image and video processors (14-pixel patches, CLIP
normalisation, per-frame video pixel bounds)."""

from __future__ import annotations

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.qwen_vl.processor import qwen_vl_processor_files


def processor_files(model_cfg: ModelConfig, data_cfg: DataConfig) -> dict[str, dict]:
    return qwen_vl_processor_files(model_cfg, data_cfg, processor_class="Qwen2_5_VLProcessor",
                                   video_processor_class="Qwen2VLVideoProcessor")
