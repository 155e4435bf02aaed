"""ERNIE-4.5-VL's processor files (``ModelFamily.hf_processor_files``): transformers' ``Ernie4_5_VLMoeProcessor``
with its image processor (smart-resize to multiples of patch x merge pixels, one temporal slot per patch) at
the run's pixel bounds and normalisation, as transformers serialises it (the PIL backend)."""

from __future__ import annotations

import json

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.qwen_vl.processor import PROCESSOR_CONFIG


def processor_files(model_cfg: ModelConfig, data_cfg: DataConfig) -> dict[str, dict]:
    # lazy: transformers (~1.5 s) only to write processor files
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil,
    )

    vis = model_cfg.vision
    image = Ernie4_5_VLMoeImageProcessorPil(
        size={"shortest_edge": data_cfg.min_pixels, "longest_edge": data_cfg.max_pixels}, patch_size=vis.patch_size,
        merge_size=model_cfg.projector.spatial_merge_size, temporal_patch_size=1, image_mean=list(vis.pixel_mean),
        image_std=list(vis.pixel_std))
    return {PROCESSOR_CONFIG: {"image_processor": json.loads(image.to_json_string()),
                               "processor_class": "Ernie4_5_VLMoeProcessor"}}
