"""Core attention modules for megatron-core's local layer specs.

megatron-core's ``SelfAttention`` projects q, k, v, applies RoPE and then calls its ``core_attention``
submodule. Its default local implementation (``DotProductAttention``) wants CUDA buffers and rejects
packed sequences, so loongforge supplies its own through the layer spec:

- ``SDPACoreAttention``: torch ``scaled_dot_product_attention`` per packed segment. Runs anywhere;
  the CPU path and the numerical reference.
- ``FlashCoreAttention``: flash-attn's varlen kernel (GPU, imported only when used).
- ``VarlenCoreAttention``: torch's own varlen kernel (``torch.nn.attention.varlen``, torch >= 2.10,
  CUDA): one call over a packed row, for GPUs without flash-attn. Its arguments (``VarlenArguments``)
  come from the same function on every path, so a CPU test can check the mask they describe.

``loongforge.models.layers.layer_backend`` picks one (or Transformer Engine's) from ``model.layer_backend``.

Input/output contract (that of ``DotProductAttention``): q ``[t, np, hd]``, k/v ``[t, ng, hd]`` when
``packed_seq_params.qkv_format == "thd"``, else q ``[s, b, np, hd]``, k/v ``[s, b, ng, hd]``; returns
``[t, np*hd]`` / ``[s, b, np*hd]``. ``ng`` (key/value groups) divides ``np``: GQA.

Under context parallelism (``parallel.context_parallel_size`` > 1, packed rows only) q, k, v hold this
CP rank's tokens (chunks r and 2CP-1-r of every sample, ``parallel.context_parallel``) while
``cu_seqlens`` are the whole row's. Both modules gather the row's keys and values over the CP group
(all-gather forward, reduce-scatter of their gradients backward) and let each local query chunk attend
to its sample's keys up to the chunk's end, causal with the diagonal at the bottom right
(``context_chunks``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from loongforge.parallel.context_parallel import gather_row, row_order


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
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if cp_comm_type not in (None, "all_gather"):
            raise ValueError(f"{type(self).__name__} gathers keys and values under context parallelism; "
                             f"cp_comm_type={cp_comm_type!r} is Transformer Engine's (parallel.context_parallel_comm)")
        self.cp_group = _context_group(config, pg_collection)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        # Multi-latent attention gives its query/key width (k_channels: rotary channels included) and
        # value width, which differ; megatron passes its softmax scale too (YaRN's mscale in it).
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

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
        """The three inputs every backend takes (the module's contract): this CP rank's tokens of packed
        rows, packed (thd) rows, or [s, b] batches; each backend's kernel calls are its own."""
        self._check_inputs(attention_mask, attention_bias)
        causal = self._is_causal(attn_mask_type)
        if self.cp_group is not None:
            # q [t/CP, np, hd], k/v [t/CP, ng, hd] -> [t/CP, np*hd]
            out = self._context_parallel(query, key, value, _causal_thd(packed_seq_params, causal))
            return out.reshape(out.shape[0], -1)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # q [t, np, hd], k/v [t, ng, hd] -> [t, np*hd]
            out = self._packed(query, key, value, packed_seq_params, causal)
            return out.reshape(out.shape[0], -1)
        # q [s, b, np, hd] -> [s, b, np*hd]
        out = self._batched(query, key, value, attention_mask, causal)
        return out.reshape(query.shape[0], query.shape[1], -1)

    def _is_causal(self, attn_mask_type: Optional[AttnMaskType]) -> bool:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        return mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)

    def _active_dropout(self) -> float:
        return self.dropout_p if self.training else 0.0


def _context_group(config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection]):
    """The CP group of a CP > 1 model, None at CP 1."""
    if config.context_parallel_size == 1:
        return None
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    return parallel_state.get_context_parallel_group()  # a model built without a collection


@dataclass
class PaddedRowParams(PackedSeqParams):
    """megatron's packed-row parameters (thd) plus the row's padding tail: the tokens at its end, a segment of
    their own (``data.collate``), that belong to no sample. Attention treats the tail as any segment; a loss
    computed inside a layer (sparse attention's indexer KL) leaves it out, as the LM loss's mask does."""

    padding_tokens: int = 0


@dataclass(frozen=True)
class QueryChunk:
    """One chunk of a sample's queries held by this CP rank, and the keys it sees."""

    query_start: int  # first local row
    length: int  # rows (queries)
    key_start: int  # first row position of the sample in the whole row
    key_length: int  # keys seen: the sample's start up to this chunk's end


def context_chunks(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> list[QueryChunk]:
    """This CP rank's query chunks in local order (per sample: chunk r, then chunk 2CP-1-r). A query
    at offset i of chunk j attends the keys of row positions [key_start, key_start + j*c + i], that is
    causal with the diagonal at the bottom right of the (length x key_length) block."""
    cu = cu_seqlens.detach().to("cpu", torch.long).tolist()
    chunks, local_start = [], 0
    for start, end in zip(cu[:-1], cu[1:]):
        chunk = (end - start) // (2 * cp_size)
        for offset, index in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
            if chunk:
                chunks.append(QueryChunk(local_start + offset * chunk, chunk, start, (index + 1) * chunk))
        local_start += 2 * chunk
    return chunks


def _gathered_keys_values(key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, group):
    """This rank's k, v [t/CP, ng, hd] -> the whole row's [t, ng, hd] each (one collective for both)."""
    row = gather_row(torch.cat([key, value], dim=-1), cu_seqlens, group, row_order(cu_seqlens, group.size()))
    return row.split([key.shape[-1], value.shape[-1]], dim=-1)


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

    def _check_inputs(self, attention_mask: Optional[torch.Tensor], attention_bias: Optional[torch.Tensor]) -> None:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention_bias")

    def _packed(self, q, k, v, packed_seq_params: PackedSeqParams, causal: bool) -> torch.Tensor:
        """q [t, np, hd], k/v [t, ng, hd] -> [t, np, hd], attending within each packed segment."""
        return self._segments(q, k, v, _segment_lengths(packed_seq_params, q.shape[0]), causal)

    def _batched(self, query, key, value, attention_mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
        """q [s, b, np, hd], k/v [s, b, ng, hd] -> [s, b, np, hd]."""
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, np, s, hd]
        mask = None
        if attention_mask is not None:
            # megatron masks are True where attention is *not* allowed; SDPA's are the opposite.
            mask, causal = ~attention_mask, False
        return self._sdpa(q, k, v, causal, mask).permute(2, 0, 1, 3)  # [b, np, s, hd] -> [s, b, np, hd]

    def _segments(self, q, k, v, lengths: list[int], causal: bool) -> torch.Tensor:
        """q [t, np, hd], k/v [t, ng, hd] -> [t, np, hd], attending within each segment.

        Segments of one length run as one batch. The row is reordered once (segments grouped by length),
        cut once and put back once: gathering or writing each group on its own would make autograd build a
        whole row's gradient per group (quadratic in a row of many samples)."""
        if len(lengths) == 1:  # one sequence: no gather/scatter needed
            return self._sdpa(*(x.transpose(0, 1)[None] for x in (q, k, v)), causal)[0].transpose(0, 1)
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        by_length: dict[int, list[int]] = {}
        for start, length in zip(starts, lengths):
            if length > 0:
                by_length.setdefault(length, []).append(start)
        # token order with the segments grouped by length: [t]
        order = torch.cat([(torch.tensor(group_starts, device=q.device)[:, None]
                            + torch.arange(length, device=q.device)).reshape(-1)
                           for length, group_starts in by_length.items()])
        sizes = [length * len(group_starts) for length, group_starts in by_length.items()]
        outputs = []
        for (length, group_starts), qs, ks, vs in zip(by_length.items(),
                                                       *(x.index_select(0, order).split(sizes) for x in (q, k, v))):
            # [n_seg * length, heads, hd] -> [n_seg, heads, length, hd]
            qs, ks, vs = (x.reshape(len(group_starts), length, *x.shape[1:]).transpose(1, 2) for x in (qs, ks, vs))
            # [n_seg, heads, length, v_hd] -> [n_seg * length, heads, v_hd] (v_hd: the values' width)
            outputs.append(self._sdpa(qs, ks, vs, causal).transpose(1, 2).reshape(-1, q.shape[1], v.shape[-1]))
        return torch.cat(outputs)[torch.argsort(order)]  # back to the row's order

    def _context_parallel(self, q, k, v, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """q [t/CP, np, hd], k/v [t/CP, ng, hd] of this CP rank -> [t/CP, np, hd]; one SDPA call per
        group of query chunks with the same (queries, keys) shape."""
        k_row, v_row = _gathered_keys_values(k, v, cu_seqlens, self.cp_group)  # [t, ng, hd] each
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # [t/CP, np, v_hd]
        by_shape: dict[tuple[int, int], list[QueryChunk]] = {}
        for chunk in context_chunks(cu_seqlens, self.cp_group.size(), self.cp_group.rank()):
            by_shape.setdefault((chunk.length, chunk.key_length), []).append(chunk)
        for (length, key_length), chunks in by_shape.items():
            q_index = _spans([c.query_start for c in chunks], length, q.device)  # [n, length]
            k_index = _spans([c.key_start for c in chunks], key_length, q.device)  # [n, key_length]
            # [n, length | key_length, heads, hd] -> [n, heads, length | key_length, hd]
            qs = q[q_index].transpose(1, 2)
            ks, vs = (x[k_index].transpose(1, 2) for x in (k_row, v_row))
            visible = torch.ones(length, key_length, dtype=torch.bool, device=q.device).tril(key_length - length)
            out[q_index] = self._sdpa(qs, ks, vs, False, visible).transpose(1, 2)
        return out

    def _sdpa(self, q, k, v, causal: bool, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        # GQA: each group of np/ng consecutive query heads shares one key/value head. SDPA reads
        # the shared heads in place (enable_gqa) instead of a repeated copy of k and v.
        divide(q.shape[1], k.shape[1])  # raises unless the groups divide the heads
        backends = sdpa_backends(q.device)
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=self._active_dropout(),
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )


# SDPA's kernels on CUDA, in order. Not cuDNN's: torch 2.11 tries it first on Hopper, and it builds an
# execution plan for every new shape, ~84 ms fwd+bwd on the H200 (flash: 0.5 ms). Packed rows of samples
# of every length meet new shapes all along a run: qwen2.5vl-tiny's steps took 0.9-14 s with it, 0.35 s
# without (docs/benchmarks/gpu.md). Efficient attention takes masks but not GQA; math takes anything.
_CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_backends(device: torch.device) -> Optional[list]:
    """The SDPA kernels this module lets torch choose from on ``device``: on CUDA all but cuDNN's; None
    (torch's own choice) elsewhere."""
    return list(_CUDA_SDPA_BACKENDS) if device.type == "cuda" else None


def _spans(starts: list[int], length: int, device) -> torch.Tensor:
    """[n, length]: rows start, start+1, ... for each start."""
    return torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)


def _causal_thd(packed_seq_params: Optional[PackedSeqParams], causal: bool) -> torch.Tensor:
    """The whole row's cu_seqlens of a CP model's input, which must be packed and causal."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd" or not causal:
        raise ValueError("context parallelism runs causal attention over packed (thd) rows only")
    return packed_seq_params.cu_seqlens_q


class FlashCoreAttention(_CoreAttentionBase):
    """flash-attn varlen kernel (GPU only; fp16/bf16). Imported lazily: optional dependency."""

    def _check_inputs(self, attention_mask: Optional[torch.Tensor], attention_bias: Optional[torch.Tensor]) -> None:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("FlashCoreAttention takes neither a mask nor a bias")

    def _packed(self, q, k, v, packed_seq_params: PackedSeqParams, causal: bool) -> torch.Tensor:
        """q [t, np, hd], k/v [t, ng, hd] -> [t, np, hd]: one varlen call over the row's segments."""
        from flash_attn import flash_attn_varlen_func  # lazy: optional, only for attention_backend=flash

        arguments = packed_varlen_arguments(packed_seq_params)
        return flash_attn_varlen_func(q, k, v, arguments.cu_q, arguments.cu_k, arguments.max_q, arguments.max_k,
                                      dropout_p=self._active_dropout(), softmax_scale=self.softmax_scale,
                                      causal=causal)

    def _batched(self, query, key, value, attention_mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
        """q [s, b, np, hd], k/v [s, b, ng, hd] -> [s, b, np, hd] (no mask: ``_check_inputs``)."""
        from flash_attn import flash_attn_func  # lazy: optional, only for attention_backend=flash

        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, heads, hd]
        out = flash_attn_func(q, k, v, dropout_p=self._active_dropout(), softmax_scale=self.softmax_scale,
                              causal=causal)
        return out.transpose(0, 1)

    def _context_parallel(self, q, k, v, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """q [t/CP, np, hd], k/v [t/CP, ng, hd] of this CP rank -> [t/CP, np, hd]: one varlen call whose
        query segments are the local chunks and whose key segments are the keys each chunk sees
        (flash-attn's causal mask has its diagonal at the bottom right when keys outnumber queries)."""
        from flash_attn import flash_attn_varlen_func  # lazy: optional, only for attention_backend=flash

        k_row, v_row = _gathered_keys_values(k, v, cu_seqlens, self.cp_group)  # [t, ng, hd] each
        arguments = context_varlen_arguments(cu_seqlens, self.cp_group.size(), self.cp_group.rank(), q.device)
        return flash_attn_varlen_func(
            q, k_row[arguments.key_rows], v_row[arguments.key_rows], arguments.cu_q, arguments.cu_k,
            arguments.max_q, arguments.max_k, dropout_p=self._active_dropout(), softmax_scale=self.softmax_scale,
            causal=True)  # [t/CP, np, hd]


@dataclass(frozen=True)
class VarlenArguments:
    """What a varlen kernel takes besides q, k, v: query segment i (rows ``cu_q[i]:cu_q[i+1]`` of q)
    attends key segment i (rows ``cu_k[i]:cu_k[i+1]`` of the keys given), causal with the diagonal at
    the bottom right (the last query sees the last key). ``key_rows``: the row positions of the keys
    to give, in order (None: k and v as they are)."""

    cu_q: torch.Tensor  # [n + 1] int32
    cu_k: torch.Tensor  # [n + 1] int32
    max_q: int
    max_k: int
    key_rows: Optional[torch.Tensor] = None  # [sum of key lengths] long


def packed_varlen_arguments(packed_seq_params: PackedSeqParams) -> VarlenArguments:
    """A packed row (no CP): each segment (sample with its own padding; the row's padding tail is a
    segment of its own) attends itself, in one call: cu_seqlens as they are, no grouping by length.
    The longest segment as ``train.step`` gave it (read from the device only where it did not: a sync)."""
    cu = packed_seq_params.cu_seqlens_q.to(torch.int32)  # [n_segments + 1]
    longest = packed_seq_params.max_seqlen_q
    if longest is None:
        longest = int((cu[1:] - cu[:-1]).max())
    return VarlenArguments(cu, cu, longest, longest)


def context_varlen_arguments(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, device) -> VarlenArguments:
    """This CP rank's query chunks (``context_chunks``) as query segments, and as key segments the
    gathered row's keys each chunk sees: its sample's start up to the chunk's end."""
    chunks = context_chunks(cu_seqlens, cp_size, cp_rank)
    key_rows = torch.cat([torch.arange(c.key_start, c.key_start + c.key_length) for c in chunks]).to(device)
    return VarlenArguments(_cumulative([c.length for c in chunks], device),
                           _cumulative([c.key_length for c in chunks], device),
                           max(c.length for c in chunks), max(c.key_length for c in chunks), key_rows)


class VarlenCoreAttention(SDPACoreAttention):
    """torch's varlen attention (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10; CUDA,
    fp16/bf16): packed rows in one call, CP shards in one call. Batched [s, b] inputs (with masks) stay
    SDPA's."""

    def _packed(self, q, k, v, packed_seq_params: PackedSeqParams, causal: bool) -> torch.Tensor:
        """q [t, np, hd], k/v [t, ng, hd] -> [t, np, hd]: one call over the row's segments (cu_seqlens
        unchecked, as flash-attn's: reading them back would stop the GPU at every layer)."""
        return self._varlen(q, k, v, packed_varlen_arguments(packed_seq_params), causal)

    def _context_parallel(self, q, k, v, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """q [t/CP, np, hd], k/v [t/CP, ng, hd] of this CP rank -> [t/CP, np, hd]."""
        k_row, v_row = _gathered_keys_values(k, v, cu_seqlens, self.cp_group)  # [t, ng, hd] each
        arguments = context_varlen_arguments(cu_seqlens, self.cp_group.size(), self.cp_group.rank(), q.device)
        return self._varlen(q, k_row[arguments.key_rows], v_row[arguments.key_rows], arguments, True)

    def _varlen(self, q, k, v, arguments: VarlenArguments, causal: bool) -> torch.Tensor:
        if self._active_dropout():
            raise ValueError("torch's varlen attention has no dropout; set the attention dropout to 0 or use "
                             "model.layer_backend=sdpa")
        # lazy: torch >= 2.10 only (the project supports 2.6); layer_backend picks varlen where it imports
        from torch.nn.attention.varlen import varlen_attn

        divide(q.shape[1], k.shape[1])  # raises unless the groups divide the heads
        return varlen_attn(q, k, v, arguments.cu_q, arguments.cu_k, arguments.max_q, arguments.max_k,
                           scale=self.softmax_scale, window_size=(-1, 0) if causal else (-1, -1),
                           enable_gqa=k.shape[1] != q.shape[1])  # [t, np, v_hd]


def _cumulative(lengths: list[int], device) -> torch.Tensor:
    """[n + 1] int32 offsets of consecutive segments of ``lengths``."""
    return torch.tensor([0, *lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
