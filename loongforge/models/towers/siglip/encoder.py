"""SigLIP and the MLP projector as one ``VisionEncoder``: one token per patch of each square image. A
plain backbone: any composition can use it, and a VLM that packs its features further (LLaVA-OneVision's
anyres with its newline) subclasses it in its own folder. Its settings are checked by ``checks.problems``
(before a run, and again here, where a part is built alone)."""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_specs import transformer_layer_spec
from loongforge.models.layers.layer_backend import layer_norm_modules
from loongforge.models.towers.siglip.checks import problems
from loongforge.models.towers.siglip.vision import MLPProjector, VisionModel
from loongforge.models.vlm.vision_configs import (
    layer_norm_vit_config,
    to_language_width_config,
)
from loongforge.models.vlm.encoder import EncoderBuild, TowerThenProjector, refuse, seeded_parts


def build_parts(build: EncoderBuild, **more) -> dict[str, torch.nn.Module]:
    """SigLIP (``vision_model``), the projector and ``more`` parts (name -> maker), each from its seeded
    stream, in that order."""
    model_cfg, tp, dtype, on_cpu = build.model_cfg, build.vision_tp, build.params_dtype, build.on_cpu
    refuse(problems(model_cfg))
    # no_mask: bidirectional inside each image; TE maps it to "padding" for packed input.
    layer_spec = transformer_layer_spec(layer_norm_modules(build.modules), AttnMaskType.no_mask)
    vision_config = layer_norm_vit_config(model_cfg, tp, dtype, on_cpu, recompute=build.recompute)
    projector_config = to_language_width_config(model_cfg, tp, dtype, on_cpu)
    return seeded_parts(build.init_seed,
                        vision_model=lambda: VisionModel(vision_config, model_cfg, layer_spec, build.pgs),
                        projector=lambda: MLPProjector(projector_config, model_cfg, build.tp_group, build.modules),
                        **more)


class SiglipEncoder(TowerThenProjector):
    """pixel rows [squares * side^2, C*p*p] + grids (squares, side, side) -> one feature row per patch
    [squares * side^2, LM hidden]."""

    def __init__(self, vision_model: VisionModel, projector: MLPProjector, model_cfg: ModelConfig):
        super().__init__(vision_model, projector, model_cfg, merge_unit=1)

    @classmethod
    def build(cls, build: EncoderBuild) -> "SiglipEncoder":
        made = build_parts(build)
        return cls(made["vision_model"], made["projector"], build.model_cfg)
