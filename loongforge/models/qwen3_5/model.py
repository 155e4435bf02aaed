"""Qwen3.5 on megatron-core: Qwen3-VL's vision part without DeepStack (``models/towers/qwen3_vit``)
composed with the shared decoder in its hybrid form (``models.vlm``): three of every four layers
Gated DeltaNet (``models.decoder.gated_delta_net``), the fourth gated full attention, every RMSNorm zero-centred,
interleaved M-RoPE on the first quarter of each head's channels (``partial_rotary_factor``).

Mirrors transformers' ``Qwen3_5ForConditionalGeneration`` (``hf_mapping.py`` gives the weight
correspondence).
"""

from __future__ import annotations

import functools

from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models import parts
from loongforge.models.decoder.configs import rotary_channels
from loongforge.models.towers.qwen3_vit.encoder import Qwen3VLEncoder
from loongforge.models.towers.qwen3_vit.vision_facts import Qwen3VisionConfig
from loongforge.models.vlm.interleaved_mrope import InterleavedMRoPE
from loongforge.models.vlm.model import VisionLanguageModel, build_vlm


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, **options) -> VisionLanguageModel:
    """This rank's pipeline stage: ``vlm.model.build_vlm`` with the Qwen3-VL tower and Qwen3.5's rotary;
    ``options`` are that function's (``params_dtype``, ``pre_process``, ``device``, ``with_encoder``, ...)."""
    vision = Qwen3VisionConfig.from_model_cfg(model_cfg)
    lang = model_cfg.language
    if vision.num_deepstack_layers:
        raise ValueError(f"model.vision.deepstack_layers={list(vision.deepstack_visual_indexes)}: Qwen3.5 has no "
                         "DeepStack; set it to []")
    if vision.out_hidden_size != lang.hidden_size:
        raise ValueError(f"model.projector.out_hidden_size={vision.out_hidden_size} must equal "
                         f"model.language.hidden_size={lang.hidden_size}")
    return build_vlm(
        model_cfg, parallel_cfg, parts.tower("qwen3_vit"), side_sets=0, merge_unit=vision.spatial_merge_size**2,
        build_encoder=functools.partial(Qwen3VLEncoder.build, vision=vision),
        rotary=lambda: InterleavedMRoPE(rotary_channels(lang), lang.mrope_section, lang.rope_theta), **options)
