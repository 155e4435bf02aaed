"""InternVL's processor files (``ModelFamily.hf_processor_files``): transformers' ``InternVLProcessor``
with its image processor (``GotOcr2ImageProcessor`` cropping to tiles) at the run's tile size, tile
budget and normalisation, as transformers serialises it (the PIL backend, which
``towers/intern_vit/processor.py`` is bit-equal to)."""

from __future__ import annotations

import json

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.qwen_vl.processor import PROCESSOR_CONFIG
from loongforge.models.towers.intern_vit.processor import tokens_per_tile


def processor_files(model_cfg: ModelConfig, data_cfg: DataConfig) -> dict[str, dict]:
    # lazy: transformers (~1.5 s) only to write processor files
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )

    vis = model_cfg.vision
    image = GotOcr2ImageProcessorPil(size={"height": vis.image_size, "width": vis.image_size}, crop_to_patches=True,
                                     min_patches=1, max_patches=data_cfg.max_tiles, image_mean=list(vis.pixel_mean),
                                     image_std=list(vis.pixel_std))
    return {PROCESSOR_CONFIG: {"image_processor": json.loads(image.to_json_string()),
                               "image_seq_length": tokens_per_tile(vis.image_size, vis.patch_size),
                               "processor_class": "InternVLProcessor"}}
