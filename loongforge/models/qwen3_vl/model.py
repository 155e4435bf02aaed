"""Qwen3-VL (dense, or Qwen3-VL-MoE with megatron-core's MoE layer in every decoder layer) on
megatron-core: its vision part (``models/towers/qwen3_vit``: the ViT with learned positions, the
merger and DeepStack's mergers) composed with the shared decoder (Qwen3 blocks: per-head q/k
RMSNorm, no qkv bias) under interleaved M-RoPE (``vlm.interleaved_mrope``), DeepStack's features
added after the first decoder layers (``models.vlm``).

Mirrors transformers' ``Qwen3VLForConditionalGeneration`` (``hf_mapping.py`` gives the weight
correspondence). Its layouts are the composition's but ``encoder_dp=full`` (``FAMILY.layout``).
"""

from __future__ import annotations

import functools
from typing import Optional

from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models import parts
from loongforge.models.decoder.layer_costs import head_dim
from loongforge.models.vlm.interleaved_mrope import InterleavedMRoPE
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
    if parallel_cfg.encoder_dp == "full":
        raise ValueError("parallel.encoder_dp='full' is not supported by Qwen3-VL yet; use none or tp")
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
