"""Qwen3-VL's vision part: the ViT, its merger and DeepStack's mergers as one ``VisionEncoder``.

Per merged token it gives the merger's features followed by each DeepStack level's (decoder layer
order): [P / m^2, (1 + k) * h]; the composed model (``models.vlm``) writes the first over the
placeholders and adds the k others after the first k decoder layers, and splits stored rows
(``loongforge encode``'s) the same way. The model adopts the three children under their names, so
state-dict keys, checkpoint keys and initial weights for a seed are the same in training and alone.
"""

from __future__ import annotations

from typing import Optional

import torch

from loongforge.models.towers.qwen3_vit import configs
from loongforge.models.towers.qwen3_vit.layer_specs import vision_layer_spec
from loongforge.models.towers.qwen3_vit.vision import (
    MergerList,
    PatchMerger,
    VisionModel,
)
from loongforge.models.towers.qwen3_vit.vision_facts import Qwen3VisionConfig
from loongforge.models.vlm.encoder import (
    EncoderBuild,
    VisionEncoder,
    seeded_parts,
)


class Qwen3VLEncoder(VisionEncoder):
    """pixel rows [P, C*T*p*p] + grid_thw [n, 3] -> [P / m^2, (1 + k) * h]: the merger's features,
    then DeepStack's, concatenated per merged token."""

    projector_parts = ("projector", "deepstack_projectors")

    def __init__(self, vision: Qwen3VisionConfig, vision_model: VisionModel, projector: PatchMerger,
                 deepstack_projectors: MergerList):
        super().__init__(merge_unit=vision.spatial_merge_size**2, out_hidden=vision.out_hidden_size,
                         side_sets=vision.num_deepstack_layers)
        self.vision = vision
        self.vision_model = vision_model
        self.projector = projector
        self.deepstack_projectors = deepstack_projectors

    @classmethod
    def build(cls, build: EncoderBuild, vision: Optional[Qwen3VisionConfig] = None) -> "Qwen3VLEncoder":
        """``vision``: the Qwen3-VL vision facts; default ``Qwen3VisionConfig.from_model_cfg``."""
        vision = vision or Qwen3VisionConfig.from_model_cfg(build.model_cfg)
        tp, dtype, on_cpu = build.vision_tp, build.params_dtype, build.on_cpu
        vision_config = configs.vision_config(vision, tp, dtype, on_cpu, recompute=build.recompute)
        merger_config = configs.merger_config(vision, tp, dtype, on_cpu)
        made = seeded_parts(
            build.init_seed,
            vision_model=lambda: VisionModel(vision_config, vision, vision_layer_spec(build.modules), build.pgs),
            projector=lambda: PatchMerger(merger_config, vision, build.tp_group, build.modules, postshuffle_norm=False),
            deepstack_projectors=lambda: MergerList(
                PatchMerger(merger_config, vision, build.tp_group, build.modules, postshuffle_norm=True)
                for _ in vision.deepstack_visual_indexes))
        return cls(vision, **made)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        patch_features, block_outputs = self.vision_model(pixel_values, grid_thw)
        # The k-th DeepStack block, in block order, goes through its merger and after decoder layer k.
        indexes = self.vision.deepstack_visual_indexes
        order = [indexes.index(block) for block in sorted(indexes)]
        deepstack = [self.deepstack_projectors[merger](outputs) for merger, outputs in zip(order, block_outputs)]
        return torch.cat([self.projector(patch_features), *deepstack], dim=-1)
