"""LLaVA-OneVision-1.5 on megatron-core: RICE-ViT and its patch merger (``models/towers/rice_vit``) composed
with the shared decoder (Qwen3 blocks) under 1-D RoPE (``models.vlm``): image tokens are numbered as text.
Mirrors transformers' ``LlavaOnevision15ForConditionalGeneration`` (``hf_mapping.py`` gives the weight
correspondence)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models import parts
from loongforge.models.vlm.model import VisionLanguageModel, build_vlm


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, **options) -> VisionLanguageModel:
    """This rank's pipeline stage: ``vlm.model.build_vlm`` with RICE-ViT; ``options`` are that function's.
    Collective (the vision TP groups): every rank calls it."""
    return build_vlm(model_cfg, parallel_cfg, parts.tower("rice_vit"), side_sets=0,
                     merge_unit=model_cfg.projector.spatial_merge_size**2, rope="rope", **options)
