"""Qwen3-VL vision tower and patch mergers, built from megatron-core layers.

patches [P, C*T*p*p] -> patch embedding (Conv3d with bias, as a linear) + learned position
embedding -> ``depth`` megatron ``TransformerLayer``s (LayerNorm pre-norms, 2-D RoPE, full attention
within each frame, packed thd) -> patch features [P, hidden], plus the features after each DeepStack
block. Mergers turn features into language-model tokens: ``PatchMerger`` [P, hidden] ->
[P/m^2, out_hidden].

Patches arrive in merge-unit order (the processor's: the ``m*m`` patches of one merged token
consecutive) and stay in it: with no windows, nothing is reordered.

The learned position grid (``sqrt(n) x sqrt(n)``) is resampled to each image's (h, w) patch grid
bilinearly with aligned corners: patch row ``r`` of ``h`` reads grid row ``r * (side-1) / (h-1)``,
a blend of the two nearest grid rows; likewise columns. ``position_embedding_taps`` gives the four
grid cells and their weights per patch, in merge-unit order, repeated for every frame.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.models.layers.layer_backend import BlockModules
from loongforge.models.towers.qwen3_vit.vision_facts import (
    VISION_LAYER_NORM_EPS,
    Qwen3VisionConfig,
)
from loongforge.models.vlm.vision_common import (
    PackedTower,
    PatchEmbed,
    apply_mlp,
    frame_segments,
    merger_mlp,
    patch_rotary_freqs,
)

# ---------------------------------------------------------------------------------------------
# Index math (pure functions of grid_thw)
# ---------------------------------------------------------------------------------------------


def _axis_taps(length: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid indices [length, 2] and weights [length, 2] resampling ``side`` cells to ``length``
    (aligned corners: the first and last patch sit on the first and last cell)."""
    source = torch.arange(length, dtype=torch.float32) * (side - 1) / max(length - 1, 1)
    below = source.floor()
    frac = source - below
    taps = torch.stack([below, below + 1], dim=-1).long().clamp(max=side - 1)
    weights = torch.stack([1 - frac, frac], dim=-1)
    return taps, weights


def position_embedding_taps(grid_thw: torch.Tensor, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices [P, 4] into the flattened ``side x side`` position grid and their weights [P, 4]:
    each patch's bilinear blend, merge-unit major, repeated for every frame."""
    indices, weights = [], []
    for t, h, w in grid_thw.tolist():
        row_taps, row_weights = _axis_taps(h, side)
        col_taps, col_weights = _axis_taps(w, side)
        # [h, w, 2 rows, 2 cols] -> [h, w, 4]
        index = (row_taps[:, None, :, None] * side + col_taps[None, :, None, :]).reshape(h, w, 4)
        weight = (row_weights[:, None, :, None] * col_weights[None, :, None, :]).reshape(h, w, 4)
        for table, out in ((index, indices), (weight, weights)):
            # (h, w) -> (h/m, m, w/m, m) -> (h/m, w/m, m, m): merge units consecutive
            units = table.reshape(h // merge, merge, w // merge, merge, 4).permute(0, 2, 1, 3, 4)
            out.append(units.reshape(h * w, 4).repeat(t, 1))
    return torch.cat(indices).to(grid_thw.device), torch.cat(weights).to(grid_thw.device)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class VisionModel(PackedTower):
    """The ViT: patches [P, C*T*p*p] + grid_thw -> (patch features [P, hidden], the outputs [P, hidden]
    of the ``deepstack_visual_indexes`` blocks in block order)."""

    def __init__(self, config: TransformerConfig, vision: Qwen3VisionConfig, layer_spec: ModuleSpec,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config, pg_collection)
        self.vision = vision
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        self.patch_embed = PatchEmbed(patch_dim, vision.hidden_size, config.params_dtype, bias=True)
        self.pos_embed = torch.nn.Embedding(vision.num_position_embeddings, vision.hidden_size,
                                            dtype=config.params_dtype)
        self.build_layers(layer_spec, vision.depth)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        vision, merge = self.vision, self.vision.spatial_merge_size
        taps, weights = position_embedding_taps(grid_thw, vision.position_grid_side, merge)
        positions = (self.pos_embed(taps) * weights[..., None].to(self.pos_embed.weight.dtype)).sum(1)
        hidden = self.patch_embed(pixel_values) + positions  # [P, h]
        freqs = patch_rotary_freqs(grid_thw, merge, vision.head_dim)[:, None, None, :]  # [P, 1, 1, hd]
        frames = frame_segments(grid_thw)
        hidden = hidden[:, None, :]  # megatron's [s, b, h] with b = 1 (thd packing)
        deepstack = []
        for index, layer in enumerate(self.layers):
            hidden = self.run_layer(layer, hidden, freqs, frames)
            if index in vision.deepstack_visual_indexes:
                deepstack.append(hidden[:, 0])
        return hidden[:, 0], deepstack


class PatchMerger(MegatronModule):
    """LayerNorm, concatenate each merge unit, MLP (exact GELU) to the language model's width.

    [P, vision hidden] -> [P/m^2, out_hidden]. ``postshuffle_norm`` (the DeepStack mergers): the norm
    runs over each concatenated merge unit instead of each patch. Linear 1 is column- and linear 2
    row-parallel over the vision TP group, so the output is whole on every rank.
    """

    def __init__(self, config: TransformerConfig, vision: Qwen3VisionConfig, tp_group: torch.distributed.ProcessGroup,
                 modules: BlockModules, *, postshuffle_norm: bool):
        super().__init__(config=config)
        self.merged_width = vision.merged_width
        self.postshuffle_norm = postshuffle_norm
        norm_width = vision.merged_width if postshuffle_norm else vision.hidden_size
        self.norm = torch.nn.LayerNorm(norm_width, eps=VISION_LAYER_NORM_EPS, dtype=config.params_dtype)
        self.mlp = merger_mlp(config, modules, self.merged_width, tp_group)

    def forward(self, patch_features: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            merged = self.norm(patch_features.reshape(-1, self.merged_width))
        else:
            merged = self.norm(patch_features).reshape(-1, self.merged_width)
        return apply_mlp(self.mlp, merged)  # [P/m^2, out]


class MergerList(torch.nn.ModuleList):
    """The DeepStack mergers. A plain ModuleList would be saved by megatron as replicated tensors,
    recording each rank's TP shard of a merger MLP as the whole tensor; ask each merger instead."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        sharded = {}
        for index, merger in enumerate(self):
            sharded.update(merger.sharded_state_dict(f"{prefix}{index}.", sharded_offsets, metadata))
        return sharded
