"""ERNIE-4.5-VL's vision part: the ViT and the variable-resolution resampler as one ``VisionEncoder``
(``vision_model``, ``projector``), the same keys and initial weights in training and ``loongforge encode``."""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_specs import transformer_layer_spec
from loongforge.models.layers.layer_backend import layer_norm_modules
from loongforge.models.towers.ernie_vit.checks import problems
from loongforge.models.towers.ernie_vit.vision import TEMPORAL_MERGE, Resampler, VisionModel
from loongforge.models.vlm.encoder import EncoderBuild, TowerThenProjector, refuse, seeded_parts
from loongforge.models.vlm.vision_configs import layer_norm_vit_config, projector_mlp_config


def resampler_configs(model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool):
    """The resampler's two MLPs (GELU, biased): m^2 h -> m^2 h -> m^2 h, and 2 m^2 h -> m^2 h -> m^2 h."""
    width = model_cfg.vision.hidden_size * model_cfg.projector.spatial_merge_size**2
    made = [projector_mlp_config(out_width=width, ffn_width=width, heads=model_cfg.vision.num_heads,
                                 hidden_act=model_cfg.projector.hidden_act, vision_tp=vision_tp,
                                 params_dtype=params_dtype, on_cpu=on_cpu) for _ in range(TEMPORAL_MERGE)]
    return made[0], made[1]


class ErnieVisionEncoder(TowerThenProjector):
    """pixel rows [P, C*p*p] + grid_thw [n, 3] -> tokens [P / m^2 (a video: / 2 more), LM hidden]."""

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision_model(pixel_values, grid_thw), grid_thw)

    @classmethod
    def build(cls, build: EncoderBuild) -> "ErnieVisionEncoder":
        model_cfg, tp, dtype, on_cpu = build.model_cfg, build.vision_tp, build.params_dtype, build.on_cpu
        refuse(problems(model_cfg))
        # no_mask: bidirectional inside each frame; TE maps it to "padding" for packed input.
        layer_spec = transformer_layer_spec(layer_norm_modules(build.modules), AttnMaskType.no_mask)
        vision_config = layer_norm_vit_config(model_cfg, tp, dtype, on_cpu, recompute=build.recompute)
        spatial, temporal = resampler_configs(model_cfg, tp, dtype, on_cpu)
        made = seeded_parts(build.init_seed,
                            vision_model=lambda: VisionModel(vision_config, model_cfg, layer_spec, build.pgs),
                            projector=lambda: Resampler(spatial, temporal, model_cfg, build.tp_group, build.modules))
        return cls(made["vision_model"], made["projector"], model_cfg,
                   merge_unit=model_cfg.projector.spatial_merge_size**2)
