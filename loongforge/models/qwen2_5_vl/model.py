"""Qwen2.5-VL on megatron-core: its vision part (``models/towers/qwen2_5_vit``: the ViT with window
attention and the patch merger) composed with the shared decoder under contiguous M-RoPE
(``models.vlm``).

Mirrors transformers' ``Qwen2_5_VLForConditionalGeneration`` module for module (``hf_mapping.py``
gives the weight correspondence); every layout of the composition applies: vision TP below the
language TP, ``encoder_dp`` none / tp / full, ``encoder_cp``.
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models import parts
from loongforge.models.vlm.model import VisionLanguageModel, build_vlm


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, **options) -> VisionLanguageModel:
    """This rank's pipeline stage: ``vlm.model.build_vlm`` with Qwen2.5-VL's vision part; ``options``
    are that function's (``params_dtype``, ``pre_process``, ``post_process``, ``device``, ...).
    Collective (the vision TP groups): every rank calls it."""
    _check_qwen2_5_vl(model_cfg)
    return build_vlm(model_cfg, parallel_cfg, parts.tower("qwen2_5_vit"), side_sets=0,
                     merge_unit=model_cfg.projector.spatial_merge_size**2, **options)


def _check_qwen2_5_vl(model_cfg: ModelConfig) -> None:
    """Settings of other families this model has no part for are errors, not silently ignored."""
    vision, lang = model_cfg.vision, model_cfg.language
    foreign = [f"model.vision.norm={vision.norm}" if vision.norm != "rms" else "",
               "model.vision.num_position_embeddings" if vision.num_position_embeddings is not None else "",
               "model.vision.deepstack_layers" if vision.deepstack_layers else "",
               "model.vision.qk_norm" if vision.qk_norm else "",
               "model.vision.qkv_bias=false" if not vision.qkv_bias else "",
               "model.language.mrope_interleaved" if lang.mrope_interleaved else ""]
    foreign = [item for item in foreign if item]
    if foreign:
        raise ValueError(f"{', '.join(foreign)}: not part of a Qwen2.5-VL model (RMSNorm vision blocks, no "
                         f"learned positions or DeepStack, contiguous M-RoPE); unset them")
