"""InternVL's vision part: InternViT and the pixel-shuffle projector as one ``VisionEncoder``."""

from __future__ import annotations


from loongforge.config.schema import ModelConfig
from loongforge.models.projectors.pixel_shuffle_mlp import PixelShuffleProjector
from loongforge.models.towers.intern_vit.checks import NORMALIZATION, problems
from loongforge.models.towers.intern_vit.layer_specs import vision_layer_spec
from loongforge.models.towers.intern_vit.vision import VisionModel
from loongforge.models.vlm.vision_common import square_side
from loongforge.models.vlm.vision_configs import to_language_width_config, tower_config
from loongforge.models.vlm.encoder import EncoderBuild, TowerThenProjector, refuse, seeded_parts

# The projector's LayerNorm: transformers' ``nn.LayerNorm`` default.
PROJECTOR_NORM_EPS = 1e-5


class InternVLEncoder(TowerThenProjector):
    """pixel rows [tiles * side^2, C*p*p] + grids (1, side, side) per tile -> merged features
    [tiles * side^2 / 4, LM hidden]."""

    @classmethod
    def build(cls, build: EncoderBuild) -> "InternVLEncoder":
        model_cfg, tp, dtype, on_cpu = build.model_cfg, build.vision_tp, build.params_dtype, build.on_cpu
        refuse(problems(model_cfg))
        vis = model_cfg.vision
        vision_config = tower_config(vis, tp, dtype, on_cpu, recompute=build.recompute, gated=False,
                                     normalization=NORMALIZATION[vis.norm], eps=vis.rms_norm_eps)
        projector_config = to_language_width_config(model_cfg, tp, dtype, on_cpu, norm_eps=PROJECTOR_NORM_EPS)
        layer_spec = vision_layer_spec(build.modules, norm=vis.norm, qkv_bias=vis.qkv_bias,
                                       qk_norm_tp_group=build.tp_group if vis.qk_norm else None)
        made = seeded_parts(
            build.init_seed, vision_model=lambda: VisionModel(vision_config, model_cfg, layer_spec, build.pgs),
            projector=lambda: PixelShuffleProjector(projector_config, vision_hidden_size=vis.hidden_size,
                                                    tile_side=square_side(vis), tp_group=build.tp_group,
                                                    modules=build.modules))
        return cls(made["vision_model"], made["projector"], model_cfg, merge_unit=4)
