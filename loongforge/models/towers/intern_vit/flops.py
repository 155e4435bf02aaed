"""The FLOPs of InternVL's vision part per training micro-batch (convention in ``models.flops``).

What runs (``vision.py``): the patch embedding (a linear over ``C*p*p`` pixels) on every patch of
every tile; ``depth`` blocks of QKV, output projection and a plain GELU MLP over each tile's patches
and its class token, attending within the tile (layer scale: an elementwise product, not counted);
then the projector per merged token (2 x 2 patches): ``4w -> out -> out``.

``tile_flops`` counts ``num_tiles`` tiles of any published InternViT from its ``InternViTConfig``;
``encoder_flops`` is the part contract's count of a micro-batch's tiles, through it.
"""

from __future__ import annotations

from typing import Sequence

from loongforge.config.schema import ModelConfig
from loongforge.models.flops import (
    FlopOptions,
    Grid,
    attention_flops,
    linear_flops,
    patch_embedding_passes,
    projector_passes,
    vision_block_linear_flops,
    vision_block_passes,
    vision_block_saved_values,
)
from loongforge.models.towers.intern_vit.config import InternViTConfig


def tile_forward_flops(config: InternViTConfig, num_tiles: int, text_hidden_size: int) -> tuple[int, int, int]:
    """(patch embedding, blocks, projector) forward FLOPs of ``num_tiles`` tiles: every tile is one
    attention segment of its patches and its class token."""
    h, side = config.hidden_size, config.patches_per_side
    patches, length = num_tiles * side * side, side * side + 1
    embedding = linear_flops(patches, config.num_channels * config.patch_size**2, h)
    per_block = (vision_block_linear_flops(num_tiles * length, h, config.intermediate_size, gated=False)
                 + attention_flops([length] * num_tiles, h))
    merged_tokens, merged = num_tiles * config.tokens_per_tile, h * config.merge_factor**2
    projector = linear_flops(merged_tokens, merged, text_hidden_size) + linear_flops(
        merged_tokens, text_hidden_size, text_hidden_size)
    return embedding, config.num_hidden_layers * per_block, projector


def tile_flops(config: InternViTConfig, num_tiles: int, text_hidden_size: int,
               options: FlopOptions = FlopOptions()) -> tuple[int, int]:
    """(vision, projector) training FLOPs of ``num_tiles`` tiles: blocks and projector forward x 3
    when trained (x 4 under recompute), the patch embedding x 2 (no pixel gradient), per ``models.flops``."""
    embedding, blocks, projector = tile_forward_flops(config, num_tiles, text_hidden_size)
    vision = patch_embedding_passes(options) * embedding + vision_block_passes(options) * blocks
    return vision, projector_passes(options) * projector


def saved_values(model_cfg: ModelConfig, tp: int) -> float:
    """Values a block saves per patch (``TowerPart.saved_values``): a plain GELU MLP (the class token's row
    per tile left out: under 0.4% of a 448-pixel tile's 1024 patches)."""
    config = InternViTConfig.from_schema(model_cfg.vision, model_cfg.projector)
    return vision_block_saved_values(config.hidden_size, config.intermediate_size, tp, gated=False)


def encoder_flops(model_cfg: ModelConfig, grids: Sequence[Grid], options: FlopOptions) -> tuple[int, int]:
    """(vision, projector) FLOPs of the micro-batch's tiles ``grids`` (each (1, side, side)):
    ``flops.EncoderFlops``, the run's tower counted as ``tile_flops`` counts it."""
    tiles = sum(t for t, _, _ in grids)
    config = InternViTConfig.from_schema(model_cfg.vision, model_cfg.projector)
    return tile_flops(config, tiles, model_cfg.projector.out_hidden_size, options)
