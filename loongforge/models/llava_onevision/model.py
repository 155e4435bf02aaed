"""LLaVA-OneVision on megatron-core: its vision part (``vision.VISION``: SigLIP, the MLP projector and the
anyres packing with its learned newline) composed with the shared decoder (Qwen2 blocks) under 1-D RoPE
(``models.vlm``). Mirrors transformers' ``LlavaOnevisionForConditionalGeneration`` (``hf_mapping.py`` gives
the weight correspondence). Its encoder packs each image's features by the image's size (the media batch's
sizes), so it runs whole images where it is: encoder_dp none.
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models.llava_onevision.vision import VISION
from loongforge.models.vlm.model import VisionLanguageModel, build_vlm


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, **options) -> VisionLanguageModel:
    """This rank's pipeline stage: ``vlm.model.build_vlm`` with LLaVA-OneVision's vision part; ``options``
    are that function's. Collective (the vision TP groups): every rank calls it."""
    return build_vlm(model_cfg, parallel_cfg, VISION, side_sets=0, merge_unit=1, rope="rope",
                     **options)
