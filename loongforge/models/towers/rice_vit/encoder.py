"""RICE-ViT and its patch merger as one ``VisionEncoder``: one feature row per merged token. Its settings are
checked by ``checks.problems`` (before a run, and again here, where a part is built alone)."""

from __future__ import annotations

from megatron.core.transformer.enums import AttnMaskType

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_specs import transformer_layer_spec
from loongforge.models.layers.layer_backend import layer_norm_modules
from loongforge.models.towers.rice_vit.checks import problems
from loongforge.models.towers.rice_vit.vision import PatchMerger, VisionModel
from loongforge.models.vlm.encoder import EncoderBuild, TowerThenProjector, refuse, seeded_parts
from loongforge.models.vlm.vision_configs import layer_norm_vit_config, projector_mlp_config


class RiceViTEncoder(TowerThenProjector):
    """pixel rows [P, C*p*p] + grid_thw [n, 3] -> [P / m^2, LM hidden]."""

    def __init__(self, vision_model: VisionModel, projector: PatchMerger, model_cfg: ModelConfig):
        super().__init__(vision_model, projector, model_cfg, merge_unit=model_cfg.projector.spatial_merge_size**2)

    @classmethod
    def build(cls, build: EncoderBuild) -> "RiceViTEncoder":
        model_cfg, tp, dtype, on_cpu = build.model_cfg, build.vision_tp, build.params_dtype, build.on_cpu
        refuse(problems(model_cfg))
        vis, proj = model_cfg.vision, model_cfg.projector
        # no_mask: bidirectional inside each frame; TE maps it to "padding" for packed input.
        layer_spec = transformer_layer_spec(layer_norm_modules(build.modules), AttnMaskType.no_mask)
        vision_config = layer_norm_vit_config(model_cfg, tp, dtype, on_cpu, recompute=build.recompute)
        merger_config = projector_mlp_config(
            out_width=proj.out_hidden_size, ffn_width=vis.hidden_size * proj.spatial_merge_size**2,
            heads=vis.num_heads, hidden_act=proj.hidden_act, vision_tp=tp, params_dtype=dtype, on_cpu=on_cpu)
        made = seeded_parts(
            build.init_seed,
            vision_model=lambda: VisionModel(vision_config, model_cfg, layer_spec, build.pgs),
            projector=lambda: PatchMerger(merger_config, model_cfg, build.tp_group, build.modules))
        return cls(made["vision_model"], made["projector"], model_cfg)
