"""Qwen2.5-VL vision tower and patch merger, built from megatron-core layers.

megatron-core has no Qwen2-VL ViT, so this file composes one: a patch embedding, ``depth``
megatron ``TransformerLayer``s (spec from ``layer_specs.vision_layer_spec``) fed packed (thd) input,
and the merger MLP. What is Qwen-specific lives in small pure functions:

- ``patch_positions``: (h, w) grid coordinates of every patch, in the order the image processor
  emits patches (merge-unit major: the ``m*m`` patches of one merged token are consecutive).
- ``window_partition``: the order in which merge units are visited window by window, and the
  window ``cu_seqlens``; blocks outside ``fullatt_block_indexes`` attend only inside a window.
- ``frame_cu_seqlens``: full-attention segments; every frame of every image/video is its own.

``patch_positions``, ``frame_cu_seqlens`` and the 2-D rotary angles are shared with Qwen3-VL
(``models.vlm.vision_common``); ``window_partition`` is Qwen2.5-VL's own.

Several images/videos in one call never attend to each other: every segment boundary above is also
an image boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.layers.layer_backend import BlockModules, RMSNorm
from loongforge.models.vlm.vision_common import (
    PackedTower,
    PatchEmbed,
    apply_mlp,
    frame_segments,
    merger_mlp,
    packed_segments,
    patch_rotary_freqs,
)

# ---------------------------------------------------------------------------------------------
# Index math (pure functions of grid_thw; those shared with Qwen3-VL are in ``vision_common``)
# ---------------------------------------------------------------------------------------------


def window_partition(
    grid_thw: torch.Tensor, merge: int, window_units: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Visit order of merge units window by window, and the window segments in patches.

    Each frame's ``(h/m) x (w/m)`` grid of merge units is tiled with ``window_units`` squares from
    the top-left (edge windows are smaller). Returns ``order`` [P/m^2] (indices of merge units in
    input order) and ``cu_seqlens`` [num_windows + 1] int32 over patches in visit order.
    """
    order, window_sizes, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        n_h, n_w = -(-gh // window_units), -(-gw // window_units)
        units = torch.arange(t * gh * gw).reshape(t, gh, gw)
        # pad to whole windows with -1, then group (frame, window row, window col)
        padded = F.pad(units, (0, n_w * window_units - gw, 0, n_h * window_units - gh), value=-1)
        windows = padded.reshape(t, n_h, window_units, n_w, window_units).permute(0, 1, 3, 2, 4)
        windows = windows.reshape(t * n_h * n_w, window_units * window_units)
        valid = windows >= 0
        order.append(windows[valid] + offset)
        window_sizes.append(valid.sum(1) * merge * merge)
        offset += t * gh * gw
    sizes = torch.cat(window_sizes)
    sizes = sizes[sizes > 0]
    cu_seqlens = F.pad(sizes.cumsum(0, dtype=torch.int32), (1, 0))
    return torch.cat(order).to(grid_thw.device), cu_seqlens.to(grid_thw.device)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class VisionModel(PackedTower):
    """The ViT: patches [P, C*T*p*p] + grid_thw -> patch features [P, hidden], input order."""

    def __init__(
        self,
        config: TransformerConfig,
        model_cfg: ModelConfig,
        layer_spec: ModuleSpec,
        pg_collection: ProcessGroupCollection,
    ):
        vis = model_cfg.vision
        super().__init__(config, pg_collection)
        self.merge = model_cfg.projector.spatial_merge_size
        self.window_units = vis.window.size // self.merge // vis.patch_size
        self.head_dim = vis.hidden_size // vis.num_heads
        self.fullatt_block_indexes = frozenset(vis.window.fullatt_block_indexes)
        patch_dim = vis.in_channels * vis.temporal_patch_size * vis.patch_size**2
        self.patch_embed = PatchEmbed(patch_dim, vis.hidden_size, config.params_dtype)
        self.build_layers(layer_spec, vis.depth)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        order, cu_windows = window_partition(grid_thw, self.merge, self.window_units)
        window_params, full_params = packed_segments(cu_windows), frame_segments(grid_thw)
        unit = self.merge * self.merge

        def to_window_order(x: torch.Tensor) -> torch.Tensor:
            # permute whole merge units: [P, ...] -> [P/m^2, m^2, ...] -> reorder -> [P, ...]
            return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)

        hidden = to_window_order(self.patch_embed(pixel_values))  # [P, h]
        freqs = patch_rotary_freqs(grid_thw, self.merge, self.head_dim)
        freqs = to_window_order(freqs)[:, None, None, :]  # [P, 1, 1, hd]
        hidden = hidden[:, None, :]  # megatron's [s, b, h] with b = 1 (thd packing)
        for index, layer in enumerate(self.layers):
            params = full_params if index in self.fullatt_block_indexes else window_params
            hidden = self.run_layer(layer, hidden, freqs, params)
        hidden = hidden[:, 0]
        # back to input order: [P/m^2, m^2, h][argsort(order)]
        return hidden.reshape(-1, unit, hidden.shape[-1])[torch.argsort(order)].reshape(hidden.shape)


class PatchMerger(MegatronModule):
    """The projector: RMSNorm per patch, concatenate each merge unit, MLP to the LM width.

    [P, vision hidden] -> [P/m^2, out_hidden]. Linear 1 is column- and linear 2 row-parallel over the
    vision TP group, so the output is whole on every rank.
    """

    def __init__(
        self,
        config: TransformerConfig,
        model_cfg: ModelConfig,
        tp_group: torch.distributed.ProcessGroup,
        modules: BlockModules,
    ):
        super().__init__(config=config)
        vision_hidden = model_cfg.vision.hidden_size
        self.merged_width = vision_hidden * model_cfg.projector.spatial_merge_size**2
        self.ln_q = RMSNorm(config, vision_hidden, eps=model_cfg.vision.rms_norm_eps)
        self.mlp = merger_mlp(config, modules, self.merged_width, tp_group)

    def forward(self, patch_features: torch.Tensor) -> torch.Tensor:
        return apply_mlp(self.mlp, self.ln_q(patch_features).reshape(-1, self.merged_width))  # [P/m^2, out]
