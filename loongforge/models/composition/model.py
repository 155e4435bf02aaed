"""A composition's model: ``vlm.build_vlm`` with the run's tower (``model.vision.arch``, ``models.parts``)
under the decoder's rope (M-RoPE with ``model.language.mrope_section``, else 1-D: image tokens numbered as
text); and that tower alone (``loongforge encode``)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models import parts
from loongforge.models.vlm.encoder import build_part_encoder
from loongforge.models.vlm.model import VisionLanguageModel, build_vlm


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, **options) -> VisionLanguageModel:
    """This rank's pipeline stage. Collective (the vision TP groups): every rank calls it."""
    rope = "mrope" if model_cfg.language.mrope_section else "rope"
    return build_vlm(model_cfg, parallel_cfg, parts.tower(model_cfg.vision.arch),
                     side_sets=len(model_cfg.vision.deepstack_layers),
                     merge_unit=model_cfg.projector.spatial_merge_size**2, rope=rope, **options)


def build_encoder(model_cfg: ModelConfig, **options):
    """The run's tower alone (``build_part_encoder``'s ``options``)."""
    return build_part_encoder(parts.tower(model_cfg.vision.arch).encoder, model_cfg, **options)
