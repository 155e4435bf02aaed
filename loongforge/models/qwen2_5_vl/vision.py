"""Qwen2.5-VL vision tower and patch merger, built from megatron-core layers.

megatron-core has no Qwen2-VL ViT, so this file composes one: a patch embedding, ``depth``
megatron ``TransformerLayer``s (spec from ``layer_specs.vision_layer_spec``) fed packed (thd) input,
and the merger MLP. What is Qwen-specific lives in small pure functions:

- ``patch_positions``: (h, w) grid coordinates of every patch, in the order the image processor
  emits patches (merge-unit major: the ``m*m`` patches of one merged token are consecutive).
- ``window_partition``: the order in which merge units are visited window by window, and the
  window ``cu_seqlens``; blocks outside ``fullatt_block_indexes`` attend only inside a window.
- ``frame_cu_seqlens``: full-attention segments; every frame of every image/video is its own.

Several images/videos in one call never attend to each other: every segment boundary above is also
an image boundary.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, sharded_state_dict_default

from loongforge.config.schema import ModelConfig
from loongforge.models.layer_backend import BlockModules, RMSNorm
from loongforge.models.decoder.layer_specs import projector_mlp_submodules

# The 2-D rotary base of the ViT (fixed in Qwen2.5-VL; not the language model's rope_theta).
VISION_ROPE_THETA = 10000.0


# ---------------------------------------------------------------------------------------------
# Index math (pure functions of grid_thw)
# ---------------------------------------------------------------------------------------------


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[P, 2] (row, column) of each patch, merge-unit major, repeated for every frame."""
    positions = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        # (h, w) -> (h/m, m, w/m, m) -> (h/m, w/m, m, m): the m*m patches of a merge unit adjacent
        hw = torch.stack([rows, cols], dim=-1).reshape(h // merge, merge, w // merge, merge, 2)
        hw = hw.permute(0, 2, 1, 3, 4).reshape(-1, 2)
        positions.append(hw.repeat(t, 1))
    return torch.cat(positions).to(grid_thw.device)


def frame_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """[num_frames + 1] int32 patch offsets: one full-attention segment per frame."""
    frame_sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(frame_sizes.cumsum(0, dtype=torch.int32), (1, 0))


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


def rotary_freqs(positions: torch.Tensor, head_dim: int, theta: float = VISION_ROPE_THETA) -> torch.Tensor:
    """[P, head_dim] rotary angles in megatron's non-interleaved layout.

    A quarter of the head's frequencies rotate with the row, a quarter with the column; the halves
    are duplicated because megatron (like transformers) rotates ``x`` against ``rotate_half(x)``.
    """
    quarter = head_dim // 4
    exponents = torch.arange(quarter, dtype=torch.float32, device=positions.device) * 2 / (head_dim // 2)
    inv_freq = 1.0 / theta**exponents
    angles = (positions[..., None].float() * inv_freq).flatten(1)  # [P, 2 * quarter]: rows, cols
    return torch.cat([angles, angles], dim=-1)


def _packed(cu_seqlens: torch.Tensor) -> PackedSeqParams:
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class PatchEmbed(torch.nn.Module):
    """Conv3d with kernel == stride == one patch, written as the linear map it is.

    ``proj.weight`` is [hidden, C*T*p*p], transformers' Conv3d weight [hidden, C, T, p, p] flattened
    (the processor flattens each patch in the same (C, T, p, p) order).
    """

    def __init__(self, patch_dim: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.proj = torch.nn.Linear(patch_dim, hidden_size, bias=False, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [P, C*T*p*p] -> [P, hidden]
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class VisionModel(MegatronModule):
    """The ViT: patches [P, C*T*p*p] + grid_thw -> patch features [P, hidden], input order."""

    def __init__(
        self,
        config: TransformerConfig,
        model_cfg: ModelConfig,
        layer_spec: ModuleSpec,
        pg_collection: ProcessGroupCollection,
    ):
        super().__init__(config=config)
        vis = model_cfg.vision
        self.merge = model_cfg.projector.spatial_merge_size
        self.window_units = vis.window_size // self.merge // vis.patch_size
        self.head_dim = vis.hidden_size // vis.num_heads
        self.fullatt_block_indexes = frozenset(vis.fullatt_block_indexes)
        self.recompute = config.recompute_granularity == "full"
        patch_dim = vis.in_channels * vis.temporal_patch_size * vis.patch_size**2
        self.tp_group = pg_collection.tp
        self.patch_embed = PatchEmbed(patch_dim, vis.hidden_size, config.params_dtype)
        self.layers = torch.nn.ModuleList(
            build_module(layer_spec, config=config, layer_number=i + 1, pg_collection=pg_collection)
            for i in range(vis.depth)
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        order, cu_windows = window_partition(grid_thw, self.merge, self.window_units)
        window_params, full_params = _packed(cu_windows), _packed(frame_cu_seqlens(grid_thw))
        unit = self.merge * self.merge

        def to_window_order(x: torch.Tensor) -> torch.Tensor:
            # permute whole merge units: [P, ...] -> [P/m^2, m^2, ...] -> reorder -> [P, ...]
            return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)

        hidden = to_window_order(self.patch_embed(pixel_values))  # [P, h]
        freqs = rotary_freqs(patch_positions(grid_thw, self.merge), self.head_dim)
        freqs = to_window_order(freqs)[:, None, None, :]  # [P, 1, 1, hd]
        hidden = hidden[:, None, :]  # megatron's [s, b, h] with b = 1 (thd packing)
        for index, layer in enumerate(self.layers):
            params = full_params if index in self.fullatt_block_indexes else window_params
            hidden = self._run_layer(layer, hidden, freqs, params)
        hidden = hidden[:, 0]
        # back to input order: [P/m^2, m^2, h][argsort(order)]
        return hidden.reshape(-1, unit, hidden.shape[-1])[torch.argsort(order)].reshape(hidden.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Per-block sharded tensors with their true (vision-TP) global shapes.

        ``self.layers`` is a plain ModuleList, which megatron's default would treat as replicated
        tensors, recording each rank's TP shard as the whole tensor; ask each block instead.
        """
        sharded = {}
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        for name, child in self.named_children():
            if name != "layers":
                # Replicated over the vision TP group: replica ids count its ranks.
                sharded.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets,
                                                          metadata, tp_group=self.tp_group))
        for index, layer in enumerate(self.layers):
            sharded.update(layer.sharded_state_dict(f"{prefix}layers.{index}.", sharded_offsets,
                                                    metadata))
        return sharded

    def _run_layer(self, layer, hidden, freqs, params):
        def run(x):
            output, _ = layer(
                hidden_states=x, attention_mask=None, rotary_pos_emb=freqs, packed_seq_params=params
            )
            return output

        if self.recompute and self.training:
            return torch.utils.checkpoint.checkpoint(run, hidden, use_reentrant=False)
        return run(hidden)


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
        self.mlp = MLP(
            config=config,
            submodules=projector_mlp_submodules(modules),
            input_size=self.merged_width,
            ffn_hidden_size=self.merged_width,
            tp_group=tp_group,
        )

    def forward(self, patch_features: torch.Tensor) -> torch.Tensor:
        merged = self.ln_q(patch_features).reshape(-1, 1, self.merged_width)  # [P/m^2, 1, m^2 h]
        out, bias = self.mlp(merged)
        if bias is not None:
            out = out + bias
        return out[:, 0]


def vision_pg_collection(
    tp_group: torch.distributed.ProcessGroup, language_pgs: ProcessGroupCollection
) -> ProcessGroupCollection:
    """Process groups the ViT layers are built with: their own TP group; the (size-1) CP group and
    the PP group come from the language model (the ViT is whole on the first pipeline stage)."""
    if language_pgs.cp.size() != 1:
        raise ValueError("the vision tower does not support context parallelism")
    return ProcessGroupCollection(tp=tp_group, cp=language_pgs.cp, pp=language_pgs.pp)


def optional_cat(*tensors: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if present else None
