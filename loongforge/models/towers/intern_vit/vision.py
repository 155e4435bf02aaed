"""InternViT and InternVL's pixel-shuffle projector, built from megatron-core layers.

A tile is a square image of ``image_size`` pixels, cut into ``(image_size / patch)^2`` patches in
row-major order: its pixel rows are [patches, C*p*p] (``PatchEmbed``: the Conv2d with kernel =
stride = one patch as the linear map it is), and its grid is ``(1, side, side)``. Each tile is one
sequence: a learned class token first, the learned absolute position table added, then ``depth``
megatron layers (``layer_specs``: LayerNorm pre-norms, layer scale) attending within the tile
(packed thd, one segment per tile). The class token is dropped after the last layer.

The projector merges each 2 x 2 block of patch features (transformers' ``pixel_shuffle`` at
downsample ratio 0.5: the four channels of merged token (i, j) are patches (2i, 2j), (2i, 2j+1),
(2i+1, 2j), (2i+1, 2j+1)) and runs LayerNorm + Linear + GELU + Linear to the language model's width.
"""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.layer_backend import BlockModules, layer_norm_modules
from loongforge.models.vision_common import (
    PackedTower,
    PatchEmbed,
    apply_mlp,
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


class PixelShuffleProjector(MegatronModule):
    """[tiles * side^2, vision hidden] -> [tiles * side^2 / 4, LM hidden]: each 2 x 2 block of patch
    features concatenated, then LayerNorm + MLP; linear 1 column- and linear 2 row-parallel over the
    vision TP group, so the output is whole on every rank."""

    def __init__(self, config: TransformerConfig, model_cfg: ModelConfig, tp_group: torch.distributed.ProcessGroup,
                 modules: BlockModules):
        super().__init__(config=config)
        self.side = square_side(model_cfg.vision)
        self.merged_width = model_cfg.vision.hidden_size * 4
        submodules = MLPSubmodules(linear_fc1=layer_norm_modules(modules).norm_column_linear,
                                   linear_fc2=modules.row_linear)
        self.mlp = MLP(config=config, submodules=submodules, input_size=self.merged_width, tp_group=tp_group)

    def forward(self, patch_features: torch.Tensor) -> torch.Tensor:
        half = self.side // 2
        # [tiles, i, a, j, b, h] with row 2i+a, column 2j+b -> [tiles, i, j, a, b, h]
        blocks = patch_features.view(-1, half, 2, half, 2, patch_features.shape[-1]).permute(0, 1, 3, 2, 4, 5)
        return apply_mlp(self.mlp, blocks.reshape(-1, self.merged_width))  # [tiles * half^2, out]
