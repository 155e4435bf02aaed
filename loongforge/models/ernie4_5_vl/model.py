"""ERNIE-4.5-VL on megatron-core: its vision part (``models/towers/ernie_vit``: the ViT and the resampler)
composed with the shared decoder (``models.vlm``) whose sparse layers hold modality-isolated experts
(``decoder.modality_moe``), under interleaved-pair 3-D RoPE (``vlm.paired_mrope``).

Mirrors transformers' ``Ernie4_5_VLMoeForConditionalGeneration`` (``hf_mapping.py`` gives the weights).
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models import parts
from loongforge.models.decoder.layer_costs import head_dim
from loongforge.models.ernie4_5_vl.hf_config import config_problems
from loongforge.models.ernie4_5_vl.hf_inputs import routing_token_ids
from loongforge.models.vlm.model import VisionLanguageModel, build_vlm
from loongforge.models.vlm.paired_mrope import PairedMRoPE


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, **options) -> VisionLanguageModel:
    """This rank's pipeline stage: ``vlm.model.build_vlm`` with ERNIE-4.5-VL's vision part, rotary and expert
    routing; ``options`` are that function's. Collective (the vision TP groups): every rank calls it."""
    problems = config_problems(model_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    lang = model_cfg.language
    return build_vlm(model_cfg, parallel_cfg, parts.tower("ernie_vit"), side_sets=0,
                     merge_unit=model_cfg.projector.spatial_merge_size**2,
                     rotary=lambda: PairedMRoPE(head_dim(lang), lang.mrope_section, lang.rope_theta),
                     rotary_interleaved=True, routing_token_ids=routing_token_ids(model_cfg), **options)
