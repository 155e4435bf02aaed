"""RICE-ViT and its patch merger, built from megatron-core layers.

patches [P, C*p*p] -> patch embedding (Conv2d without bias, as a linear) -> each frame's class token put
before its patches -> LayerNorm -> ``depth`` megatron ``TransformerLayer``s (LayerNorm pre-norms, 2-D RoPE,
full attention within each frame and its class token, packed thd) -> the class tokens dropped -> patch
features [P, hidden]. ``PatchMerger``: LayerNorm per patch, the ``m x m`` patches of a merged token
concatenated, an MLP (exact GELU) -> [P / m^2, out_hidden].

Patches arrive in merge-unit order (the processor's) and rotate by their (row, column) as in Qwen's ViTs
(``vision_common.patch_rotary_freqs``). A class token rotates by learned angles (``class_rotary``: half a
head's worth, duplicated as the patches' are); since q and k are split over the vision TP group by heads,
each rank's gradient of those angles is its own heads' share, summed over the group in the backward.
"""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.layers.layer_backend import BlockModules
from loongforge.models.vlm.vision_common import (
    PackedTower,
    PatchEmbed,
    apply_mlp,
    merger_mlp,
    packed_segments,
    patch_rotary_freqs,
)


def with_class_rows(rows: torch.Tensor, class_row: torch.Tensor, frame_sizes: list[int]) -> torch.Tensor:
    """rows [P, ...] of frames of ``frame_sizes`` patches -> [P + frames, ...]: ``class_row`` [1, ...] before each
    frame's rows."""
    pieces = []
    for frame in rows.split(frame_sizes):
        pieces += [class_row, frame]
    return torch.cat(pieces)


class VisionModel(PackedTower):
    """RICE-ViT: pixel rows [P, C*p*p] + grid_thw [n, 3] -> patch features [P, hidden] (merge-unit order, the
    class tokens dropped)."""

    def __init__(self, config: TransformerConfig, model_cfg: ModelConfig, layer_spec: ModuleSpec,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config, pg_collection)
        vis = model_cfg.vision
        hidden, dtype = vis.hidden_size, config.params_dtype
        self.merge = model_cfg.projector.spatial_merge_size
        self.head_dim = hidden // vis.num_heads
        self.patch_embed = PatchEmbed(vis.in_channels * vis.patch_size**2, hidden, dtype, bias=False)
        std = hidden**-0.5  # transformers' initialisation of both
        self.class_embedding = torch.nn.Parameter(torch.randn(hidden, dtype=dtype) * std)
        self.class_rotary = torch.nn.Parameter(torch.randn(self.head_dim // 2, dtype=dtype) * std)
        self.pre_layernorm = torch.nn.LayerNorm(hidden, eps=vis.rms_norm_eps, dtype=dtype)
        self.build_layers(layer_spec, vis.depth)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        frame_sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).tolist()
        hidden = with_class_rows(self.patch_embed(pixel_values), self.class_embedding[None], frame_sizes)
        hidden = self.pre_layernorm(hidden)[:, None, :]  # megatron's [s, b, h] with b = 1 (thd packing)
        angles = copy_to_tensor_model_parallel_region(self.class_rotary, group=self.tp_group)
        class_freqs = torch.cat([angles, angles]).float()[None]  # [1, hd]
        freqs = with_class_rows(patch_rotary_freqs(grid_thw, self.merge, self.head_dim), class_freqs, frame_sizes)
        lengths = torch.tensor([0] + [size + 1 for size in frame_sizes], device=hidden.device)
        segments = packed_segments(lengths.cumsum(0).to(torch.int32))
        for layer in self.layers:
            hidden = self.run_layer(layer, hidden, freqs[:, None, None, :], segments)
        keep = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        keep[lengths.cumsum(0)[:-1]] = False  # each frame's first row: its class token
        return hidden[keep, 0]


class PatchMerger(MegatronModule):
    """LayerNorm per patch, concatenate each merge unit, MLP (exact GELU) to the language model's width:
    [P, vision hidden] -> [P / m^2, out_hidden]. Linear 1 is column- and linear 2 row-parallel over the vision
    TP group, so the output is whole on every rank."""

    def __init__(self, config: TransformerConfig, model_cfg: ModelConfig, tp_group: torch.distributed.ProcessGroup,
                 modules: BlockModules):
        super().__init__(config=config)
        vis = model_cfg.vision
        self.merged_width = vis.hidden_size * model_cfg.projector.spatial_merge_size**2
        self.norm = torch.nn.LayerNorm(vis.hidden_size, eps=vis.rms_norm_eps, dtype=config.params_dtype)
        self.mlp = merger_mlp(config, modules, self.merged_width, tp_group)

    def forward(self, patch_features: torch.Tensor) -> torch.Tensor:
        return apply_mlp(self.mlp, self.norm(patch_features).reshape(-1, self.merged_width))
