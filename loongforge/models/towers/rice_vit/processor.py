"""RICE-ViT's image processing: transformers' Qwen2-VL image processor (what LLaVA-OneVision-1.5's
``AutoImageProcessor`` is) with one frame per temporal patch, so each patch row is ``C * p * p`` pixels, what
the tower's Conv2d reads. The shared smart resize (``models/qwen_vl/smart_resize.py``) is bit-equal to it at
``temporal_patch_size=1`` (``tests/models/test_llava_onevision1_5.py``). Torch-free."""

from __future__ import annotations

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.qwen_vl.smart_resize import SmartResizeImages, smart_resize_images


def rice_images(model_cfg: ModelConfig, data_cfg: DataConfig) -> SmartResizeImages:
    """The run's image processing (``TowerPart.images``): smart resize inside ``data.min_pixels`` ..
    ``max_pixels`` at the tower's patch, merge and normalisation (``checks`` keeps one frame a patch)."""
    return smart_resize_images(model_cfg, data_cfg)
