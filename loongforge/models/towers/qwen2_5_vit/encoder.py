"""Qwen2.5-VL's vision part: the ViT and its patch merger as one ``VisionEncoder``.

The composed model (``models.vlm``) adopts its two children under their names (``vision_model``,
``projector``), and ``loongforge encode`` runs it alone (``vlm.encoder.build_part_encoder``): the same state-dict
keys, checkpoint keys and initial weights for a seed, so stored embeddings are the features training
computes with the same weights.
"""

from __future__ import annotations

import torch

from loongforge.config.schema import ModelConfig
from loongforge.models.towers.qwen2_5_vit import configs
from loongforge.models.towers.qwen2_5_vit.layer_specs import vision_layer_spec
from loongforge.models.towers.qwen2_5_vit.vision import PatchMerger, VisionModel
from loongforge.models.vlm.encoder import (
    EncoderBuild,
    VisionEncoder,
    seeded_parts,
)


class Qwen2_5_VLEncoder(VisionEncoder):
    """pixel rows [P, C*T*p*p] + grid_thw [n, 3] -> merged features [P / m^2, out_hidden]."""

    def __init__(self, vision_model: VisionModel, projector: PatchMerger, model_cfg: ModelConfig):
        super().__init__(merge_unit=model_cfg.projector.spatial_merge_size**2,
                         out_hidden=model_cfg.projector.out_hidden_size)
        self.vision_model = vision_model
        self.projector = projector

    @classmethod
    def build(cls, build: EncoderBuild) -> "Qwen2_5_VLEncoder":
        model_cfg, tp, dtype, on_cpu = build.model_cfg, build.vision_tp, build.params_dtype, build.on_cpu
        vision_config = configs.vision_config(model_cfg, tp, dtype, on_cpu, recompute=build.recompute)
        projector_config = configs.projector_config(model_cfg, tp, dtype, on_cpu)
        layer_spec = vision_layer_spec(build.modules)
        made = seeded_parts(build.init_seed,
                            vision_model=lambda: VisionModel(vision_config, model_cfg, layer_spec, build.pgs),
                            projector=lambda: PatchMerger(projector_config, model_cfg, build.tp_group, build.modules))
        return cls(made["vision_model"], made["projector"], model_cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision_model(pixel_values, grid_thw))
