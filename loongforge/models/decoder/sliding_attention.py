"""MiMo-V2-Flash's attention (``model.language.sliding_window``) as a megatron-core module in a
``TransformerLayer``'s self-attention slot, for its two layer kinds.

Per token one projection gives, per key/value group, the group's queries, its key and its value
(``[q_g (r heads x d_qk), k_g (d_qk), v_g (d_v)]``, r = heads / groups): values are narrower than
queries and keys, which megatron's ``SelfAttention`` does not build. The values are multiplied by
``value_scale``; the first ``rotary_percent`` of each query and key head is rotated (the rest passes),
in halves as transformers' ``rotate_half``, under the layer kind's own RoPE theta (each layer owns its
rotary table; the model's shared one is the full layers'). TP splits whole groups (the projection
column-parallel, the output row-parallel), so a rank's heads are a contiguous block at every TP size
(``hf_rules.GroupedRows`` maps transformers' q/k/v projections to it).

The core attention is the project's SDPA path (``layers.attention.SDPACoreAttention``) with two additions,
each where the layer has it:

- a sliding window: a query sees itself and the ``window - 1`` positions before it, a mask on the
  causal one; packed rows attend segment by segment, so a window never reaches into another sample;
- sinks: one learned logit per head joins every softmax's denominator without a value, as an extra key
  column (a zero key and value whose additive mask entry is the head's logit). The logits are split over TP
  with the heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide

from loongforge.models.layers.attention import SDPACoreAttention
from loongforge.models.layers.initialization import draws_on_cpu, seeded_below


@dataclass
class SlidingWindowTransformerConfig(TransformerConfig):
    """megatron's decoder settings plus MiMo-V2-Flash's attention (``configs.sliding_window``)."""

    sliding_layer_pattern: list[int] = field(default_factory=list)  # 1: a sliding layer, by global index
    sliding_window_size: int = 129  # positions a query sees, itself included
    sliding_num_query_groups: int = 8
    sliding_rotary_base: float = 10_000.0
    sliding_attention_sinks: bool = True
    full_rotary_base: float = 10_000.0
    attention_rotary_percent: float = 1.0
    attention_v_head_dim: int = 128
    attention_value_scale: float = 1.0


@dataclass
class SlidingWindowAttentionSubmodules:
    linear_qkv: type  # column-parallel, with the layer's pre-norm fused in (``layer_norm_weight``)
    linear_proj: type  # row-parallel


class SinkWindowCoreAttention(SDPACoreAttention):
    """SDPA with an optional sliding window and optional per-head sink logits (``sinks``: this rank's heads)."""

    def __init__(self, config: TransformerConfig, layer_number: int, *, window: Optional[int], heads: Optional[int],
                 softmax_scale: float, pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config, layer_number, AttnMaskType.causal, "self", softmax_scale=softmax_scale,
                         pg_collection=pg_collection)
        self.tp_group = (pg_collection or ProcessGroupCollection.use_mpu_process_groups()).tp
        self.window = window
        self.sinks = None
        if heads is not None:
            self.sinks = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            # Split over TP with the heads: the grad norm counts each rank's part.
            self.sinks.tensor_model_parallel, self.sinks.partition_dim, self.sinks.partition_stride = True, 0, 1

    def _sdpa(self, q, k, v, causal: bool, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [n, np, L, d], k [n, ng, S, d], v [n, ng, S, d_v] -> [n, np, L, d_v]; the queries are the last L of
        the S positions (the diagonal at the bottom right)."""
        if self.window is None and self.sinks is None:
            return super()._sdpa(q, k, v, causal, mask)
        length, keys = q.shape[2], k.shape[2]
        rows = torch.arange(length, device=q.device)[:, None] + (keys - length)  # each query's position
        cols = torch.arange(keys, device=q.device)[None]
        visible = cols <= rows if mask is None else mask  # [L, S] or broadcastable, True where seen
        if self.window is not None:
            visible = visible & (rows - cols < self.window)
        additive = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
        if self.sinks is None:
            return super()._sdpa(q, k, v, False, additive)
        heads = q.shape[1]
        # The sink: a zero key (score 0) whose additive mask entry is the head's logit, and a zero value.
        k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[-1])], dim=2)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[-1])], dim=2)
        sink = self.sinks.to(q.dtype)[:, None, None].expand(heads, length, 1)
        additive = torch.cat([additive.expand(heads, length, keys), sink], dim=-1)[None]  # [1, np, L, S + 1]
        return super()._sdpa(q, k, v, False, additive)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(own, prefix, {"sinks": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


class SlidingWindowAttention(MegatronModule):
    """A full (``sliding`` false) or sliding-window layer's attention: [s(/tp), b, h] -> ([s(/tp), b, h], bias)."""

    def __init__(self, config: SlidingWindowTransformerConfig, submodules: SlidingWindowAttentionSubmodules,
                 layer_number: int, sliding: bool = False, pg_collection: Optional[ProcessGroupCollection] = None,
                 cp_comm_type: Optional[str] = None, **unused):
        super().__init__(config=config)
        self.layer_number = layer_number
        groups_pg = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        self.tp_group = groups_pg.tp
        tp = self.tp_group.size()
        heads = config.num_attention_heads
        groups = config.sliding_num_query_groups if sliding else config.num_query_groups
        self.local_heads, self.local_groups = divide(heads, tp), divide(groups, tp)
        self.qk_dim, self.v_dim = config.kv_channels, config.attention_v_head_dim
        self.group_rows = (divide(heads, groups) * self.qk_dim, self.qk_dim, self.v_dim)  # q, k, v of one group
        self.value_scale = config.attention_value_scale
        self.linear_qkv = build_module(
            submodules.linear_qkv, config.hidden_size, groups * sum(self.group_rows), config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="qkv", tp_group=self.tp_group)
        self.core_attention = SinkWindowCoreAttention(
            config, layer_number, window=config.sliding_window_size if sliding else None,
            heads=self.local_heads if sliding and config.sliding_attention_sinks else None,
            softmax_scale=1.0 / math.sqrt(self.qk_dim), pg_collection=groups_pg)
        self.linear_proj = build_module(
            submodules.linear_proj, heads * self.v_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="proj", tp_group=self.tp_group)
        self.rotary = RotaryEmbedding(
            self.qk_dim, config.attention_rotary_percent,
            rotary_base=config.sliding_rotary_base if sliding else config.full_rotary_base,
            use_cpu_initialization=config.use_cpu_initialization, cp_group=groups_pg.cp)
        self._draw_sinks(heads)

    def _draw_sinks(self, heads: int) -> None:
        """The sink logits drawn whole (normal, the init std, as transformers' ``_init_weights``) and sliced to
        this rank, so every TP size starts from one model."""
        sinks = self.core_attention.sinks
        if sinks is None:
            return
        if not draws_on_cpu(self.config):
            with torch.no_grad():
                sinks.normal_(0.0, self.config.init_method_std)
            return
        with seeded_below("self_attention.core_attention.sinks"):
            whole = torch.empty(heads).normal_(0.0, self.config.init_method_std)
        with torch.no_grad():
            sinks.copy_(whole.chunk(self.tp_group.size())[self.tp_group.rank()].to(sinks.dtype))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *,
                packed_seq_params: Optional[PackedSeqParams] = None, **unused):
        qkv, _ = self.linear_qkv(hidden_states)  # [s, b, groups * rows] (the whole sequence under SP)
        seq_len, batch = qkv.shape[:2]
        q, k, v = qkv.reshape(seq_len, batch, self.local_groups, -1).split(self.group_rows, dim=-1)
        q = q.reshape(seq_len, batch, self.local_heads, self.qk_dim)  # [s, b, np, d]
        v = v * self.value_scale  # [s, b, ng, d_v]
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        freqs = self.rotary(seq_len, packed_seq=packed)  # [s, 1, 1, rotary channels]
        if packed:  # [t, 1, heads, d] -> [t, heads, d], positions restarting at every sample
            q, k, v = (x.squeeze(1) for x in (q, k, v))
            cu_seqlens = packed_seq_params.cu_seqlens_q
            q = apply_rotary_pos_emb(q, freqs, self.config, cu_seqlens=cu_seqlens, cp_group=self.rotary.cp_group)
            k = apply_rotary_pos_emb(k, freqs, self.config, cu_seqlens=cu_seqlens, cp_group=self.rotary.cp_group)
        else:
            q = apply_rotary_pos_emb(q, freqs, self.config, cp_group=self.rotary.cp_group)
            k = apply_rotary_pos_emb(k, freqs, self.config, cp_group=self.rotary.cp_group)
        out = self.core_attention(q, k, v, None, packed_seq_params=packed_seq_params)
        if packed:
            out = out.reshape(out.shape[0], 1, -1)  # [t, np*d_v] -> [t, 1, np*d_v]
        return self.linear_proj(out)
