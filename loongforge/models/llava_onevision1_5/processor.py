"""LLaVA-OneVision-1.5's processor files (``ModelFamily.hf_processor_files``): the processor transformers'
``AutoProcessor`` builds for it (``Exaone4_5_Processor``) with Qwen2-VL's image and video processors at the
run's pixel bounds, 14-pixel patches and one frame a temporal patch."""

from __future__ import annotations

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.qwen_vl.processor import qwen_vl_processor_files


def processor_files(model_cfg: ModelConfig, data_cfg: DataConfig) -> dict[str, dict]:
    return qwen_vl_processor_files(model_cfg, data_cfg, processor_class="Exaone4_5_Processor",
                                   video_processor_class="Qwen2VLVideoProcessor")
