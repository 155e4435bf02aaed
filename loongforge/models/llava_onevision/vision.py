"""LLaVA-OneVision's vision part: the SigLIP tower (``models/towers/siglip``) with the family's own anyres
image processing, its encoder (the packing and the newline on top of SigLIP's features) and the newline's
parameters. Torch-free: the registry and plans read it without building a model."""

from __future__ import annotations

from dataclasses import replace

from loongforge.config.schema import ModelConfig
from loongforge.models.llava_onevision.anyres import anyres_images
from loongforge.models.towers.siglip import PART as SIGLIP


def vision_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(SigLIP's, the projector's and the newline vector's) parameter counts."""
    vision, projector = SIGLIP.parameters(model_cfg)
    return vision, projector + model_cfg.projector.out_hidden_size


def anyres_problems(model_cfg: ModelConfig) -> list[str]:
    """The anyres settings the family's processor tiles by must be given."""
    if model_cfg.vision is not None and model_cfg.vision.anyres is None:
        return ["model.vision.anyres is null: LLaVA-OneVision's processor tiles a single image by it; give its "
                "pinpoints (the (height, width) canvases) and max_crops"]
    return []


VISION = replace(SIGLIP, encoder="loongforge.models.llava_onevision.encoder:LlavaOnevisionEncoder",
                 images=anyres_images, parameters=vision_parameters)
