"""Family-independent pieces of Qwen-style vision towers and of writing their features into text.

Qwen2.5-VL and Qwen3-VL emit patches in merge-unit order (the ``m*m`` patches of one merged token
consecutive), rotate each patch by its 2-D (row, column) grid position, and attend within each frame;
their models write the merged features over placeholder tokens. Those index and scatter rules live
here, once; what differs between the families (windows, norms, position embeddings) stays in each
family's ``vision.py``.
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
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from loongforge.models.decoder.layer_specs import projector_mlp_submodules
from loongforge.models.layers.layer_backend import BlockModules
from loongforge.parallel.context_parallel import ContextShard

# The 2-D rotary base of the ViT (fixed in Qwen2.5-VL and Qwen3-VL; not the language model's rope_theta).
VISION_ROPE_THETA = 10000.0


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


def square_side(vision) -> int:
    """Patches along the side of a fixed-size square input (``model.vision.image_size``)."""
    return vision.image_size // vision.patch_size


def square_media_count(grid_thw: torch.Tensor, side: int, tower: str) -> int:
    """Squares in ``grid_thw`` [n, 3] of a tower that sees fixed-size squares: each grid is ``(t, side,
    side)``, t squares (an image's tiles or crops, encoded each on its own); a ValueError naming the
    grids otherwise."""
    if grid_thw.numel() and not bool((grid_thw[:, 1:] == side).all() and (grid_thw[:, 0] >= 1).all()):
        raise ValueError(f"{tower} encodes squares of {side} x {side} patches (grids (t, {side}, {side})), "
                         f"got grids {grid_thw.tolist()}")
    return int(grid_thw[:, 0].sum())


def square_pixels(rows: torch.Tensor, patch_size: int, channels: int, side: int) -> torch.Tensor:
    """Patch rows [n * side^2, C*p*p] (``models.vlm.pixels.patch_rows``) back to the squares' whole patches
    [n, C, side*p, side*p] (what a processor's pixel_values hold, less any pixels past the last whole patch)."""
    squares = rows.view(-1, side, side, channels, patch_size, patch_size)  # [n, row, column, C, py, px]
    return squares.permute(0, 3, 1, 4, 2, 5).reshape(-1, channels, side * patch_size, side * patch_size)


def frame_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """[num_frames + 1] int32 patch offsets: one full-attention segment per frame."""
    frame_sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(frame_sizes.cumsum(0, dtype=torch.int32), (1, 0))


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


def packed_segments(cu_seqlens: torch.Tensor) -> PackedSeqParams:
    """thd parameters of self-attention within each ``cu_seqlens`` segment."""
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


def patch_rotary_freqs(grid_thw: torch.Tensor, merge: int, head_dim: int) -> torch.Tensor:
    """[P, head_dim] 2-D rotary angles of every patch of ``grid_thw`` in the processor's (merge-unit
    major) patch order: the Qwen ViTs' rotary embedding."""
    return rotary_freqs(patch_positions(grid_thw, merge), head_dim)


def frame_segments(grid_thw: torch.Tensor) -> PackedSeqParams:
    """thd parameters of full attention within each frame of every medium of ``grid_thw``."""
    return packed_segments(frame_cu_seqlens(grid_thw))


def vision_pg_collection(
    tp_group: torch.distributed.ProcessGroup, language_pgs: ProcessGroupCollection,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> ProcessGroupCollection:
    """Process groups the ViT layers are built with: their own TP group, a CP group of this rank
    alone (``cp_group``, default the language's, which must then be of size 1: an image is never split
    over CP ranks) and the language model's PP group (the ViT is whole on a pipeline stage)."""
    cp_group = language_pgs.cp if cp_group is None else cp_group
    if cp_group.size() != 1:
        raise ValueError("the vision tower is built with a CP group of one rank (BuildContext.encoder_cp)")
    return ProcessGroupCollection(tp=tp_group, cp=cp_group, pp=language_pgs.pp)


def optional_cat(*tensors: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The given tensors one after another (the read-only inputs of a step: a lone one is returned as it is,
    not copied); None without any."""
    present = [t for t in tensors if t is not None]
    if len(present) <= 1:
        return present[0] if present else None
    return torch.cat(present)


def scatter_features(
    embeddings: torch.Tensor, input_ids: torch.Tensor, token_id: int, features: torch.Tensor
) -> torch.Tensor:
    """Write features [n, h] over the placeholder positions of embeddings [s, b, h], in (batch,
    position) order."""
    if features.shape[0] == 0:
        return embeddings
    mask = (input_ids == token_id)[..., None]  # [b, s, 1]
    merged = embeddings.transpose(0, 1).masked_scatter(mask, features)  # [b, s, h]
    return merged.transpose(0, 1).contiguous()


class PatchEmbed(torch.nn.Module):
    """Conv3d with kernel == stride == one patch (with a bias or not), written as the linear map it is.

    ``proj.weight`` is [hidden, C*T*p*p], transformers' Conv3d weight [hidden, C, T, p, p] flattened
    (the processor flattens each patch in the same (C, T, p, p) order).
    """

    def __init__(self, patch_dim: int, hidden_size: int, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        self.proj = torch.nn.Linear(patch_dim, hidden_size, bias=bias, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [P, C*T*p*p] -> [P, hidden]
        return self.proj(pixel_values.to(self.proj.weight.dtype))


def held_features(features: torch.Tensor, token_id: int, context_shard: Optional[ContextShard]) -> torch.Tensor:
    """[n, ...] the features of the row's ``token_id`` placeholders -> those of the placeholders this
    rank's tokens hold: all of them, or this CP rank's under context parallelism (local order)."""
    return features if context_shard is None else context_shard.local_features(features, token_id)


def written_over(embeddings: torch.Tensor, features: torch.Tensor,
                 context_shard: Optional[ContextShard]) -> torch.Tensor:
    """Under context parallelism: ``embeddings`` plus 0 x the row's features, the same values with
    the features in the graph, so every CP rank's backward reaches them (and the encoder), also a
    rank whose tokens hold none of their placeholders: the encoder's gradient collectives and DDP's
    buckets wait for every rank. Without CP: ``embeddings``."""
    if context_shard is None:
        return embeddings
    return embeddings + features.sum().to(embeddings.dtype) * 0.0


class PackedTower(MegatronModule):
    """A ViT's ``depth`` megatron ``TransformerLayer``s over packed (thd) patches, each image or frame
    its own segment(s); a subclass adds its embeddings and says which segments each layer sees.

    ``self.layers`` is a plain ModuleList (the tower is whole on a pipeline stage, never split by
    megatron's block), so its sharded state dict asks each layer (``sharded_state_dict``)."""

    def __init__(self, config: TransformerConfig, pg_collection: ProcessGroupCollection):
        super().__init__(config=config)
        self.recompute = config.recompute_granularity == "full"
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp

    def build_layers(self, layer_spec: ModuleSpec, depth: int) -> None:
        """The ``depth`` layers; a subclass builds its embeddings first (their initial weights come
        first from the tower's seeded stream)."""
        self.layers = torch.nn.ModuleList(
            build_module(layer_spec, config=self.config, layer_number=i + 1, pg_collection=self.pg_collection)
            for i in range(depth)
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Per-layer sharded tensors with their true (vision-TP) global shapes: megatron's default
        would treat a plain ModuleList's tensors as replicated, recording each rank's TP shard as
        the whole tensor."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        # The tower's own tensors (InternViT's class token and position table), replicated over its TP group.
        own = {name: param for name, param in self._parameters.items() if param is not None}
        sharded = make_sharded_tensors_for_checkpoint(own, prefix, {}, sharded_offsets, tp_group=self.tp_group,
                                                      dp_cp_group=metadata["dp_cp_group"])
        for name, child in self.named_children():
            if name != "layers":
                # Replicated over the vision TP group: replica ids count its ranks.
                sharded.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets,
                                                          metadata, tp_group=self.tp_group))
        for index, layer in enumerate(self.layers):
            sharded.update(layer.sharded_state_dict(f"{prefix}layers.{index}.", sharded_offsets, metadata))
        return sharded

    def run_layer(self, layer, hidden: torch.Tensor, freqs: torch.Tensor, params: PackedSeqParams) -> torch.Tensor:
        """hidden [P, 1, h] through one layer (recomputed in the backward under full recompute)."""
        def run(x):
            output, _ = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=freqs, packed_seq_params=params)
            return output

        if self.recompute and self.training:
            return torch.utils.checkpoint.checkpoint(run, hidden, use_reentrant=False)
        return run(hidden)


def merger_mlp(config: TransformerConfig, modules: BlockModules, width: int,
               tp_group: torch.distributed.ProcessGroup) -> MLP:
    """A merger's MLP: ``width`` -> ``width`` -> ``config.hidden_size`` (megatron's MLP maps input ->
    ffn -> hidden), linear 1 column- and linear 2 row-parallel over ``tp_group``: the output is whole
    on every rank."""
    return MLP(config=config, submodules=projector_mlp_submodules(modules), input_size=width,
               ffn_hidden_size=width, tp_group=tp_group)


def apply_mlp(mlp: MLP, rows: torch.Tensor) -> torch.Tensor:
    """rows [n, width] -> [n, out] through a megatron MLP (which takes [s, b, h] and returns its
    output bias apart when it skips adding it)."""
    out, bias = mlp(rows[:, None, :])  # [n, 1, out]
    if bias is not None:
        out = out + bias
    return out[:, 0]
