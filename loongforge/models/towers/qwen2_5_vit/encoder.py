"""Qwen2.5-VL's vision part: the ViT and its patch merger as one ``VisionEncoder``.

The composed model (``models.vlm``) adopts its two children under their names (``vision_model``,
``projector``), and ``loongforge encode`` runs it alone (``vlm.encoder.build_part_encoder``): the same state-dict
keys, checkpoint keys and initial weights for a seed, so stored embeddings are the features training
computes with the same weights.
"""

from __future__ import annotations


from loongforge.config.schema import ModelConfig
from loongforge.models.towers.qwen2_5_vit import configs
from loongforge.models.towers.qwen2_5_vit.layer_specs import vision_layer_spec
from loongforge.models.towers.qwen2_5_vit.vision import PatchMerger, VisionModel
from loongforge.models.vlm.encoder import EncoderBuild, TowerThenProjector, seeded_parts


class Qwen2_5_VLEncoder(TowerThenProjector):
    """pixel rows [P, C*T*p*p] + grid_thw [n, 3] -> merged features [P / m^2, out_hidden]."""

    @classmethod
    def build(cls, build: EncoderBuild) -> "Qwen2_5_VLEncoder":
        model_cfg, tp, dtype, on_cpu = build.model_cfg, build.vision_tp, build.params_dtype, build.on_cpu
        vision_config = configs.vision_config(model_cfg, tp, dtype, on_cpu, recompute=build.recompute)
        projector_config = configs.projector_config(model_cfg, tp, dtype, on_cpu)
        layer_spec = vision_layer_spec(build.modules)
        made = seeded_parts(build.init_seed,
                            vision_model=lambda: VisionModel(vision_config, model_cfg, layer_spec, build.pgs),
                            projector=lambda: PatchMerger(projector_config, model_cfg, build.tp_group, build.modules))
        return cls(made["vision_model"], made["projector"], model_cfg,
                   merge_unit=model_cfg.projector.spatial_merge_size**2)
