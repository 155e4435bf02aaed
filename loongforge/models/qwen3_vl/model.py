"""Qwen3-VL (dense, or Qwen3-VL-MoE with megatron-core's MoE layer in every decoder layer) on
megatron-core: its vision part (``models/towers/qwen3_vit``: the ViT with learned positions, the
merger and DeepStack's mergers) composed with the shared decoder (Qwen3 blocks: per-head q/k
RMSNorm, no qkv bias) under interleaved M-RoPE (``rotary.InterleavedMRoPE``), DeepStack's features
added after the first decoder layers (``models.vlm``).

Mirrors transformers' ``Qwen3VLForConditionalGeneration`` (``hf_mapping.py`` gives the weight
correspondence). The towers run at the language TP size with ``encoder_dp=none`` (``FAMILY.layout``).
"""

from __future__ import annotations

import functools
from typing import Optional

from loongforge.config.layout import vision_tensor_parallel_size
from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models import parts
from loongforge.models.decoder.params import head_dim
from loongforge.models.qwen3_vl.rotary import InterleavedMRoPE
from loongforge.models.towers.qwen3_vit.encoder import Qwen3VLEncoder
from loongforge.models.towers.qwen3_vit.vision_facts import Qwen3VisionConfig
from loongforge.models.vlm.model import VisionLanguageModel, build_vlm


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, *,
                vision: Optional[Qwen3VisionConfig] = None, **options) -> VisionLanguageModel:
    """This rank's pipeline stage: ``vlm.model.build_vlm`` with Qwen3-VL's vision part and rotary;
    ``options`` are that function's (``params_dtype``, ``pre_process``, ``device``, ...;
    ``with_encoder=False``: no towers, training on ``loongforge encode``'s stored features, the
    merger's and DeepStack's). ``vision``: the Qwen3-VL vision facts; default
    ``Qwen3VisionConfig.from_model_cfg(model_cfg)`` (which needs the Qwen3-VL fields of ``model.vision``)."""
    vision = vision or Qwen3VisionConfig.from_model_cfg(model_cfg)
    _check_model(model_cfg, vision)
    tp = parallel_cfg.tensor_model_parallel_size
    if vision_tensor_parallel_size(parallel_cfg) != tp:
        raise ValueError(f"parallel.vision_tensor_model_parallel_size={parallel_cfg.vision_tensor_model_parallel_size}"
                         f": Qwen3-VL's vision tower runs at the language TP size ({tp}); leave it null")
    if parallel_cfg.encoder_dp != "none":
        raise ValueError(f"parallel.encoder_dp={parallel_cfg.encoder_dp!r} is not supported by Qwen3-VL yet; use none")
    lang = model_cfg.language
    return build_vlm(
        model_cfg, parallel_cfg, parts.tower("qwen3_vit"), side_sets=vision.num_deepstack_layers,
        merge_unit=vision.spatial_merge_size**2, build_encoder=functools.partial(Qwen3VLEncoder.build, vision=vision),
        rotary=lambda: InterleavedMRoPE(head_dim(lang), lang.mrope_section, lang.rope_theta), **options)


def _check_model(model_cfg: ModelConfig, vision: Qwen3VisionConfig) -> None:
    lang = model_cfg.language
    if vision.out_hidden_size != lang.hidden_size:
        raise ValueError(f"vision out_hidden_size={vision.out_hidden_size} must equal "
                         f"model.language.hidden_size={lang.hidden_size}")
    if not lang.mrope_section:
        raise ValueError("model.language.mrope_section must be set for Qwen3-VL (interleaved M-RoPE)")
    if not lang.mrope_interleaved:
        raise ValueError("model.language.mrope_interleaved=false: Qwen3-VL's M-RoPE is interleaved")
