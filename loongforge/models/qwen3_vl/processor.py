"""Qwen3-VL's processor files (``ModelFamily.hf_processor_files``): transformers' ``Qwen3VLProcessor``
(timestamped video frames) with the Qwen2-VL image processor at 16-pixel patches and
``Qwen3VLVideoProcessor`` (pixel bounds per clip); one processor serves the dense and MoE models."""

from __future__ import annotations

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.qwen_vl.processor import qwen_vl_processor_files


def processor_files(model_cfg: ModelConfig, data_cfg: DataConfig) -> dict[str, dict]:
    return qwen_vl_processor_files(model_cfg, data_cfg, processor_class="Qwen3VLProcessor",
                                   video_processor_class="Qwen3VLVideoProcessor")
