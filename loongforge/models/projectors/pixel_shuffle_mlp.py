"""The pixel-shuffle projector (InternVL's ``pixel_shuffle_mlp``): each 2 x 2 block of a tile's patch
features concatenated into one token of 4x the width (transformers' ``pixel_shuffle`` at downsample
ratio 0.5), then LayerNorm + Linear + GELU + Linear to the language model's width.

Element order: merged token (i, j) of a tile (row-major over the (side/2)^2 tokens) holds the
features of patches (2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1), in that order.

The MLP is megatron's, its LayerNorm fused into the first linear; linear 1 is column- and linear 2
row-parallel over the given TP group, so the output is whole on every rank.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.models.layers.layer_backend import BlockModules, layer_norm_modules
from loongforge.models.vlm.vision_common import apply_mlp

MERGE = 2  # patches merged along each side (downsample ratio 0.5)


def pixel_shuffle(patch_features: torch.Tensor, tile_side: int) -> torch.Tensor:
    """[tiles * side^2, C] (row-major patches per tile) -> [tiles * (side/2)^2, 4C]."""
    half, width = tile_side // MERGE, patch_features.shape[-1]
    # [tiles, i, a, j, b, C] with row 2i+a, column 2j+b -> [tiles, i, j, a, b, C]
    blocks = patch_features.view(-1, half, MERGE, half, MERGE, width).permute(0, 1, 3, 2, 4, 5)
    return blocks.reshape(-1, MERGE * MERGE * width)


class PixelShuffleProjector(MegatronModule):
    """[tiles * side^2, vision hidden] -> [tiles * side^2 / 4, LM hidden] (``config.hidden_size``)."""

    def __init__(self, config: TransformerConfig, *, vision_hidden_size: int, tile_side: int,
                 tp_group: torch.distributed.ProcessGroup, modules: BlockModules):
        super().__init__(config=config)
        if tile_side % MERGE:
            raise ValueError(f"a tile of {tile_side} x {tile_side} patches cannot be merged {MERGE} x {MERGE}")
        self.tile_side = tile_side
        submodules = MLPSubmodules(linear_fc1=layer_norm_modules(modules).norm_column_linear,
                                   linear_fc2=modules.row_linear)
        self.mlp = MLP(config=config, submodules=submodules, input_size=MERGE * MERGE * vision_hidden_size,
                       tp_group=tp_group)

    def forward(self, patch_features: torch.Tensor) -> torch.Tensor:
        return apply_mlp(self.mlp, pixel_shuffle(patch_features, self.tile_side))  # [tiles * half^2, out]
