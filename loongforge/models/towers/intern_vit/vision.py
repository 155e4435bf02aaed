"""InternViT, built from megatron-core layers (its projector: ``models/projectors/pixel_shuffle_mlp.py``).

A tile is a square image of ``image_size`` pixels, cut into ``(image_size / patch)^2`` patches in
row-major order: its pixel rows are [patches, C*p*p] (``PatchEmbed``: the Conv2d with kernel =
stride = one patch as the linear map it is), and its grid is ``(1, side, side)``. Each tile is one
sequence: a learned class token first, the learned absolute position table added, then ``depth``
megatron layers (``layer_specs``: LayerNorm or RMSNorm pre-norms, layer scale) attending within the
tile (packed thd, one segment per tile). The class token is dropped after the last layer: what
InternVL3.5 projects is that last layer's output (``vision_feature_layer=-1``, no final norm).
"""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.vlm.vision_common import (
    PackedTower,
    PatchEmbed,
    packed_segments,
    square_media_count,
    square_side,
)


class VisionModel(PackedTower):
    """InternViT: pixel rows [tiles * side^2, C*p*p] + grids -> patch features [tiles * side^2, hidden]
    (row-major within each tile, the class token dropped)."""

    def __init__(self, config: TransformerConfig, model_cfg: ModelConfig, layer_spec: ModuleSpec,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config, pg_collection)
        vis = model_cfg.vision
        self.side = square_side(model_cfg.vision)
        hidden = vis.hidden_size
        self.patch_embed = PatchEmbed(vis.in_channels * vis.patch_size**2, hidden, config.params_dtype, bias=True)
        self.cls_token = torch.nn.Parameter(torch.zeros(hidden, dtype=config.params_dtype))
        self.pos_embed = torch.nn.Parameter(torch.zeros(1 + self.side**2, hidden, dtype=config.params_dtype))
        self.build_layers(layer_spec, vis.depth)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        tiles, patches = square_media_count(grid_thw, self.side, "InternViT"), self.side**2
        hidden = self.patch_embed(pixel_values).view(tiles, patches, -1)  # [tiles, N, h]
        cls = self.cls_token.expand(tiles, 1, -1)
        hidden = torch.cat([cls, hidden], dim=1) + self.pos_embed  # [tiles, 1 + N, h]
        length = 1 + patches
        segments = packed_segments(torch.arange(tiles + 1, dtype=torch.int32, device=hidden.device) * length)
        hidden = hidden.reshape(tiles * length, 1, -1)  # megatron's [s, b, h] with b = 1 (thd packing)
        for layer in self.layers:
            hidden = self.run_layer(layer, hidden, None, segments)
        return hidden.view(tiles, length, -1)[:, 1:].reshape(tiles * patches, -1)
