"""The FLOPs of InternVL's vision part per training micro-batch (convention in ``models.flops``).

What runs (``vision.py``): the patch embedding (a linear over ``C*p*p`` pixels) on every patch of
every tile; ``depth`` blocks of QKV, output projection and a plain GELU MLP over each tile's patches
and its class token, attending within the tile (layer scale: an elementwise product, not counted);
then the projector per merged token (2 x 2 patches): ``4w -> out -> out``.

``encoder_flops`` counts a micro-batch's tiles for the part contract (``ModelConfig``);
``tile_flops`` counts ``num_tiles`` tiles of any published InternViT from its HF ``InternViTConfig``
(the same convention and numbers).
"""

from __future__ import annotations

from typing import Sequence

from loongforge.config.schema import ModelConfig
from loongforge.models.flops import (
    FlopOptions,
    Grid,
    attention_flops,
    linear_flops,
    patch_embedding_flops,
    patch_embedding_passes,
    projector_passes,
    vision_block_linear_flops,
    vision_block_passes,
)
from loongforge.models.towers.intern_vit.config import InternViTConfig


def blocks_forward_flops(model_cfg: ModelConfig, grids: Sequence[Grid]) -> int:
    """All blocks' forward over every tile (its patches and its class token)."""
    vis = model_cfg.vision
    lengths = [h * w + 1 for t, h, w in grids for _ in range(t)]
    linears = vision_block_linear_flops(sum(lengths), vis.hidden_size, vis.intermediate_size, gated=False)
    return vis.depth * (linears + attention_flops(lengths, vis.hidden_size))


def encoder_flops(model_cfg: ModelConfig, grids: Sequence[Grid], options: FlopOptions) -> tuple[int, int]:
    """(vision, projector) FLOPs of the micro-batch's tiles ``grids``: ``flops.EncoderFlops``."""
    vis, out = model_cfg.vision, model_cfg.projector.out_hidden_size
    embedding = patch_embedding_flops(grids, in_channels=vis.in_channels, temporal_patch_size=1,
                                      patch_size=vis.patch_size, width=vis.hidden_size, options=options)
    vision = embedding + vision_block_passes(options) * blocks_forward_flops(model_cfg, grids)
    merged_tokens = sum(t * h * w for t, h, w in grids) // 4
    projector = linear_flops(merged_tokens, 4 * vis.hidden_size, out) + linear_flops(merged_tokens, out, out)
    return vision, projector_passes(options) * projector


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
