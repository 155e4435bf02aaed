"""The made-up tower as one ``VisionEncoder``: pixel rows [images * side^2, 3*p*p] + grids (1, side, side)
-> features [images * side^2, LM hidden], one row per patch, plus the learned row of each image's
shape (its processor's ``wide`` fact: the squashing lost the proportions, this gives some back);
and its weight rows (HF-style names of its own: no transformers class describes a composition, the rows
give its checkpoint tensors their shapes)."""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_specs import transformer_layer_spec
from loongforge.models.media import MediaSet
from loongforge.models.hf.rules import VISION, PatchEmbedding, Replicated, Rule, Split, ViTBlockNames, vit_block_rules
from loongforge.models.layers.layer_backend import layer_norm_modules
from loongforge.models.towers.siglip.vision import MLPProjector, VisionModel
from loongforge.models.vlm.encoder import EncoderBuild, TowerThenProjector, refuse, seeded_parts
from loongforge.models.vlm.vision_configs import layer_norm_vit_config, to_language_width_config
from tests.train.made_up_tower.counts import problems
from tests.train.made_up_tower.processing import WIDE


class Orientation(torch.nn.Module):
    """Two learned rows [2, LM hidden]: an image of other proportions, a wide one."""

    def __init__(self, width: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, width, dtype=dtype) * 0.02)


class MadeUpEncoder(TowerThenProjector):
    projector_parts = ("projector", "orientation")
    reads_items = True  # the wide fact

    def __init__(self, vision_model: VisionModel, projector: MLPProjector, orientation: Orientation,
                 model_cfg: ModelConfig):
        super().__init__(vision_model, projector, model_cfg, merge_unit=1)
        self.orientation = orientation

    @classmethod
    def build(cls, build: EncoderBuild) -> "MadeUpEncoder":
        model_cfg = build.model_cfg
        refuse(problems(model_cfg))
        layer_spec = transformer_layer_spec(layer_norm_modules(build.modules), AttnMaskType.no_mask)
        vision_config = layer_norm_vit_config(model_cfg, build.vision_tp, build.params_dtype, build.on_cpu,
                                              recompute=build.recompute)
        projector_config = to_language_width_config(model_cfg, build.vision_tp, build.params_dtype, build.on_cpu)
        made = seeded_parts(build.init_seed,
                            vision_model=lambda: VisionModel(vision_config, model_cfg, layer_spec, build.pgs),
                            projector=lambda: MLPProjector(projector_config, model_cfg, build.tp_group, build.modules),
                            orientation=lambda: Orientation(model_cfg.projector.out_hidden_size, build.params_dtype))
        return cls(made["vision_model"], made["projector"], made["orientation"], model_cfg)

    def encode_images(self, images: MediaSet) -> torch.Tensor:
        if WIDE not in images.facts:
            raise ValueError("the made-up tower reads each image's wide fact: the images carry none")
        features = self(images.rows, images.grids)  # [images * side^2, LM hidden]
        per_image = self.orientation.weight[images.facts[WIDE].long()]  # [images, LM hidden]
        return features + per_image.repeat_interleave(torch.tensor(images.patches, device=features.device), dim=0)


def tower_rules(model_cfg: ModelConfig) -> list[Rule]:
    """The tower's and projector's rows under names of its own (``made_up.``)."""
    vision = model_cfg.vision
    h, rep, col, row = vision.hidden_size, Replicated(), Split(0), Split(1)
    names = ViTBlockNames(norm1="norm1", q_k_v="attn.{x}", out="attn.out", norm2="norm2", fc1="fc1", fc2="fc2")
    return [
        Rule(("made_up.patch.weight",), "vision_model.patch_embed.proj.weight",
             PatchEmbedding((h, vision.in_channels, vision.patch_size, vision.patch_size)), VISION),
        Rule(("made_up.patch.bias",), "vision_model.patch_embed.proj.bias", rep, VISION),
        Rule(("made_up.positions",), "vision_model.pos_embed.weight", rep, VISION),
        *vit_block_rules("made_up.blocks.{i}.", "vision_model.layers.{i}.", names, vision.num_heads,
                         h // vision.num_heads),
        Rule(("made_up.final_norm.weight",), "vision_model.post_layernorm.weight", rep, VISION),
        Rule(("made_up.final_norm.bias",), "vision_model.post_layernorm.bias", rep, VISION),
        Rule(("made_up.projector.fc1.weight",), "projector.mlp.linear_fc1.weight", col, VISION),
        Rule(("made_up.projector.fc1.bias",), "projector.mlp.linear_fc1.bias", col, VISION),
        Rule(("made_up.projector.fc2.weight",), "projector.mlp.linear_fc2.weight", row, VISION),
        Rule(("made_up.projector.fc2.bias",), "projector.mlp.linear_fc2.bias", rep, VISION),
        Rule(("made_up.orientation",), "orientation.weight", rep, VISION),
    ]
