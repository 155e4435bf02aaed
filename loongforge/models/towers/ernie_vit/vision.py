"""ERNIE-4.5-VL's vision transformer and its variable-resolution resampler, built from megatron-core layers.

The tower is Qwen2-VL's kind of ViT: patch rows [P, C*p*p] (the processor's merge-unit-major order: the
m*m patches of one merged token consecutive) embedded by a bias-free linear, 2-D rotary positions (row and
column, ``vision_common.patch_rotary_freqs``), ``depth`` megatron layers (LayerNorm pre-norms, a quick-GELU
MLP) attending within each frame, and a final LayerNorm.

The resampler (the projector) turns each merge unit into one language-model token:

    spatial:  the m*m patch features concatenated [n, m^2 h] -> Linear, GELU, Linear, LayerNorm
    temporal: each token concatenated with its twin in the next frame (an image: with itself) [n, 2 m^2 h]
              -> Linear (to m^2 h), GELU, Linear, LayerNorm
    then a Linear to the language model's width and an RMSNorm (the language model's epsilon).

A video's frames pair (0, 1), (2, 3), ...: its tokens are half its frames' merge units.
"""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_specs import projector_mlp_submodules
from loongforge.models.layers.layer_backend import BlockModules, RMSNorm
from loongforge.models.vlm.vision_common import (
    PackedTower,
    PatchEmbed,
    apply_mlp,
    frame_segments,
    patch_rotary_freqs,
)

# Frames one resampled video token covers (transformers' temporal_merge_size; an image is paired with itself).
TEMPORAL_MERGE = 2


class VisionModel(PackedTower):
    """The ViT: patch rows [P, C*p*p] + grid_thw [n, 3] -> patch features [P, hidden] (after the final norm)."""

    def __init__(self, config: TransformerConfig, model_cfg: ModelConfig, layer_spec: ModuleSpec,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config, pg_collection)
        vis = model_cfg.vision
        self.merge = model_cfg.projector.spatial_merge_size
        self.head_dim = vis.hidden_size // vis.num_heads
        self.patch_embed = PatchEmbed(vis.in_channels * vis.patch_size**2, vis.hidden_size, config.params_dtype)
        self.build_layers(layer_spec, vis.depth)
        self.ln = torch.nn.LayerNorm(vis.hidden_size, eps=vis.rms_norm_eps, dtype=config.params_dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        hidden = self.patch_embed(pixel_values)[:, None, :]  # megatron's [s, b, h] with b = 1 (thd packing)
        freqs = patch_rotary_freqs(grid_thw, self.merge, self.head_dim)[:, None, None, :]  # [P, 1, 1, hd]
        segments = frame_segments(grid_thw)
        for layer in self.layers:
            hidden = self.run_layer(layer, hidden, freqs, segments)
        return self.ln(hidden[:, 0])


def temporal_pairs(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, second) LongTensors [tokens]: the merge units each resampled token concatenates, in order.
    An image (t = 1) pairs every unit with itself; a video pairs frame 2k's units with frame 2k+1's."""
    first, second, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        units = h * w // merge**2
        frames = torch.arange(t * units).view(t, units) + offset
        if t == 1:
            first.append(frames[0])
            second.append(frames[0])
        else:
            pairs = t // TEMPORAL_MERGE
            first.append(frames[0 : 2 * pairs : 2].reshape(-1))
            second.append(frames[1 : 2 * pairs : 2].reshape(-1))
        offset += t * units
    return torch.cat(first).to(grid_thw.device), torch.cat(second).to(grid_thw.device)


class Resampler(MegatronModule):
    """The projector: patch features [P, h] + grid_thw -> tokens [n, LM hidden] (see the module docstring).
    The two MLPs are column- then row-parallel over the vision TP group (outputs whole on every rank); the
    norms and the last linear are replicated."""

    def __init__(self, spatial_config: TransformerConfig, temporal_config: TransformerConfig, model_cfg: ModelConfig,
                 tp_group: torch.distributed.ProcessGroup, modules: BlockModules):
        super().__init__(config=spatial_config)
        self.merge = model_cfg.projector.spatial_merge_size
        width = model_cfg.vision.hidden_size * self.merge**2
        eps, dtype = model_cfg.vision.rms_norm_eps, spatial_config.params_dtype
        self.spatial_linear = MLP(config=spatial_config, submodules=projector_mlp_submodules(modules),
                                  input_size=width, ffn_hidden_size=width, tp_group=tp_group)
        self.spatial_norm = torch.nn.LayerNorm(width, eps=eps, dtype=dtype)
        self.temporal_linear = MLP(config=temporal_config, submodules=projector_mlp_submodules(modules),
                                   input_size=TEMPORAL_MERGE * width, ffn_hidden_size=width, tp_group=tp_group)
        self.temporal_norm = torch.nn.LayerNorm(width, eps=eps, dtype=dtype)
        self.mlp = torch.nn.Linear(width, model_cfg.projector.out_hidden_size, dtype=dtype)
        self.after_norm = RMSNorm(spatial_config, model_cfg.projector.out_hidden_size,
                                  eps=model_cfg.language.rms_norm_eps)

    def forward(self, patch_features: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        units = patch_features.reshape(-1, patch_features.shape[-1] * self.merge**2)  # [P/m^2, m^2 h]
        units = self.spatial_norm(apply_mlp(self.spatial_linear, units))
        first, second = temporal_pairs(grid_thw, self.merge)
        tokens = torch.cat([units.index_select(0, first), units.index_select(0, second)], dim=-1)
        tokens = self.temporal_norm(apply_mlp(self.temporal_linear, tokens))
        return self.after_norm(self.mlp(tokens))  # [n, LM hidden]
