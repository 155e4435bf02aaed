"""Core attention modules for megatron-core's local layer specs.

megatron-core's ``SelfAttention`` projects q, k, v, applies RoPE and then calls its ``core_attention``
submodule. Its default local implementation (``DotProductAttention``) wants CUDA buffers and rejects
packed sequences, so loongforge supplies its own through the layer spec:

- ``SDPACoreAttention``: torch ``scaled_dot_product_attention`` per packed segment. Runs anywhere;
  the CPU path and the numerical reference.
- ``FlashCoreAttention``: flash-attn's varlen kernel (GPU, imported only when used).

``loongforge.models.layer_backend`` picks one (or Transformer Engine's) from ``model.layer_backend``.

Input/output contract (that of ``DotProductAttention``): q ``[t, np, hd]``, k/v ``[t, ng, hd]`` when
``packed_seq_params.qkv_format == "thd"``, else q ``[s, b, np, hd]``, k/v ``[s, b, ng, hd]``; returns
``[t, np*hd]`` / ``[s, b, np*hd]``. ``ng`` (key/value groups) divides ``np``: GQA.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class _CoreAttentionBase(MegatronModule):
    """Shared constructor: the signature ``SelfAttention`` builds core attention with."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(f"{type(self).__name__} does not support context parallelism")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _is_causal(self, attn_mask_type: Optional[AttnMaskType]) -> bool:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        return mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)


def _segment_lengths(packed_seq_params: PackedSeqParams, num_tokens: int) -> list[int]:
    cu_seqlens = packed_seq_params.cu_seqlens_q
    if packed_seq_params.cu_seqlens_kv is not None and not torch.equal(
        cu_seqlens, packed_seq_params.cu_seqlens_kv
    ):
        raise ValueError("self-attention needs cu_seqlens_q == cu_seqlens_kv")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if sum(lengths) != num_tokens:
        raise ValueError(f"cu_seqlens covers {sum(lengths)} tokens but q has {num_tokens}")
    return lengths


class SDPACoreAttention(_CoreAttentionBase):
    """torch SDPA, one call per group of equal-length packed segments.

    Batching equal-length segments matters for the vision tower, whose windows mostly share a size.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention_bias")
        causal = self._is_causal(attn_mask_type)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # q [t, np, hd], k/v [t, ng, hd] -> [t, np*hd]
            lengths = _segment_lengths(packed_seq_params, query.shape[0])
            out = self._packed(query, key, value, lengths, causal)
            return out.reshape(out.shape[0], -1)
        # q [s, b, np, hd] -> [b, np, s, hd]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None
        if attention_mask is not None:
            # megatron masks are True where attention is *not* allowed; SDPA's are the opposite.
            mask, causal = ~attention_mask, False
        out = self._sdpa(q, k, v, causal, mask)  # [b, np, s, hd]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _packed(self, q, k, v, lengths: list[int], causal: bool) -> torch.Tensor:
        """q [t, np, hd], k/v [t, ng, hd] -> [t, np, hd], attending within each segment."""
        if len(lengths) == 1:  # one sequence: no gather/scatter needed
            return self._sdpa(*(x.transpose(0, 1)[None] for x in (q, k, v)), causal)[0].transpose(0, 1)
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        out = torch.empty_like(q)
        by_length: dict[int, list[int]] = {}
        for start, length in zip(starts, lengths):
            if length > 0:
                by_length.setdefault(length, []).append(start)
        for length, group_starts in by_length.items():
            # token index of every segment of this length: [n_seg, length]
            index = torch.tensor(group_starts, device=q.device)[:, None] + torch.arange(
                length, device=q.device
            )
            # [n_seg, length, heads, hd] -> [n_seg, heads, length, hd]
            qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))
            out[index] = self._sdpa(qs, ks, vs, causal).transpose(1, 2)
        return out

    def _sdpa(self, q, k, v, causal: bool, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        # GQA: each group of np/ng consecutive query heads shares one key/value head. SDPA reads
        # the shared heads in place (enable_gqa) instead of a repeated copy of k and v.
        divide(q.shape[1], k.shape[1])  # raises unless the groups divide the heads
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )


class FlashCoreAttention(_CoreAttentionBase):
    """flash-attn varlen kernel (GPU only; fp16/bf16). Imported lazily: optional dependency."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        # lazy: optional, only for attention_backend=flash
        from flash_attn import flash_attn_func, flash_attn_varlen_func

        if attention_mask is not None or attention_bias is not None:
            raise ValueError("FlashCoreAttention takes neither a mask nor a bias")
        causal = self._is_causal(attn_mask_type)
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_seqlens = packed_seq_params.cu_seqlens_q.to(torch.int32)
            max_seqlen = packed_seq_params.max_seqlen_q
            if max_seqlen is None:
                max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            out = flash_attn_varlen_func(
                query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                dropout_p=dropout_p, softmax_scale=self.softmax_scale, causal=causal,
            )  # [t, np, hd]
            return out.reshape(out.shape[0], -1)
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, heads, hd]
        out = flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=self.softmax_scale, causal=causal)
        return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)
