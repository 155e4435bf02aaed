"""LLaVA-OneVision's processor files (``ModelFamily.hf_processor_files``): transformers'
``LlavaOnevisionProcessor`` with its image processor at the run's square size, anyres canvases and
normalisation, as transformers serialises it (the PIL backend, which ``anyres.py`` is
bit-equal to), and the processor's own settings (tokens per square, every patch kept, ``anyres_max_N``)."""

from __future__ import annotations

import json

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.qwen_vl.processor import PROCESSOR_CONFIG


def processor_files(model_cfg: ModelConfig, data_cfg: DataConfig) -> dict[str, dict]:
    # lazy: transformers (~1.5 s) only to write processor files
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    vis = model_cfg.vision
    image = LlavaOnevisionImageProcessorPil(size={"height": vis.image_size, "width": vis.image_size},
                                            image_grid_pinpoints=[list(p) for p in vis.anyres.pinpoints],
                                            image_mean=list(vis.pixel_mean), image_std=list(vis.pixel_std))
    return {PROCESSOR_CONFIG: {"image_processor": json.loads(image.to_json_string()),
                               "num_image_tokens": (vis.image_size // vis.patch_size) ** 2,
                               "vision_feature_select_strategy": "full",
                               "vision_aspect_ratio": f"anyres_max_{vis.anyres.max_crops}",
                               "image_token": "<image>", "video_token": "<video>",
                               "processor_class": "LlavaOnevisionProcessor"}}
