"""Core attention: SDPA's packed segments, GQA, causality; the arguments every varlen kernel (flash-attn's,
torch's) is given describe exactly the mask SDPA applies on CPU, padding and CP shards included."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.models.layers import attention
from loongforge.models.layers.attention import (
    SDPACoreAttention,
    VarlenArguments,
    context_varlen_arguments,
    packed_varlen_arguments,
)
from loongforge.parallel.context_parallel import local_token_index

HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def _attention(mask_type: AttnMaskType) -> SDPACoreAttention:
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
        attention_dropout=0.0,
    )
    return SDPACoreAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type="self")


def _reference(q, k, v, causal: bool) -> torch.Tensor:
    """Plain softmax attention of one sequence: q [s, np, d], k/v [s, ng, d] -> [s, np*d]."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask])
def test_packed_segments_attend_only_within_themselves(mask_type):
    lengths = [5, 3, 5, 1, 7]  # repeated lengths take the batched path
    total = sum(lengths)
    q, k, v = torch.randn(total, HEADS, HEAD_DIM), torch.randn(total, GROUPS, HEAD_DIM), torch.randn(total, GROUPS, HEAD_DIM)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    out = _attention(mask_type)(q, k, v, None, packed_seq_params=params)
    causal = mask_type == AttnMaskType.causal
    expected = torch.cat([_reference(*(x.split(lengths)[i] for x in (q, k, v)), causal) for i in range(len(lengths))])
    assert out.shape == (total, HEADS * HEAD_DIM)
    assert (out - expected).abs().max() < 1e-5


def test_sbhd_layout_is_causal_per_batch_row():
    s, b = 6, 2
    q, k, v = torch.randn(s, b, HEADS, HEAD_DIM), torch.randn(s, b, GROUPS, HEAD_DIM), torch.randn(s, b, GROUPS, HEAD_DIM)
    out = _attention(AttnMaskType.causal)(q, k, v, None)
    assert out.shape == (s, b, HEADS * HEAD_DIM)
    for row in range(b):
        assert (out[:, row] - _reference(q[:, row], k[:, row], v[:, row], causal=True)).abs().max() < 1e-5


def test_cu_seqlens_must_cover_every_token():
    q = torch.randn(4, HEADS, HEAD_DIM)
    k = v = torch.randn(4, GROUPS, HEAD_DIM)
    cu_seqlens = torch.tensor([0, 3], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    with pytest.raises(ValueError, match="covers 3 tokens"):
        _attention(AttnMaskType.causal)(q, k, v, None, packed_seq_params=params)


class _Group:
    """The size and rank a CP group reports (the gathered keys and values are handed in directly)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn runs on CUDA only")
def test_flash_context_parallel_chunks_equal_sdpa_on_the_whole_row(monkeypatch):
    """Each CP rank's varlen call (query chunks against their samples' key prefixes, bottom-right
    causal) gives the rows of whole-row SDPA it holds. The keys and values of the row are handed in
    (the CP gather is tests/parallel/test_context_parallel.py's)."""
    pytest.importorskip("flash_attn")
    cu_seqlens = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    q = torch.randn(24, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(24, GROUPS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens.cuda(), cu_seqlens_kv=cu_seqlens.cuda())
    whole = _attention(AttnMaskType.causal)(q.float(), k.float(), v.float(), None, packed_seq_params=params)
    monkeypatch.setattr(attention, "_gathered_keys_values", lambda key, value, cu, group: (k, v))
    for rank in range(2):
        config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                   num_query_groups=GROUPS, attention_dropout=0.0, context_parallel_size=2)
        flash = attention.FlashCoreAttention(config, 1, AttnMaskType.causal, "self",
                                             pg_collection=type("Groups", (), {"cp": _Group(2, rank)})())
        held = local_token_index(cu_seqlens, 2, rank).cuda()
        out = flash(q[held], k[held], v[held], None, packed_seq_params=params)  # [12, np*hd]
        worst = (out.float() - whole[held]).abs().max().item()
        print(f"CP rank {rank}: flash chunks vs whole-row SDPA {worst:.1e} (bf16)")
        assert worst < 3e-2


# A packed row as data.collate makes it at CP 2: samples of 5, 3 and 7 real tokens, each padded to a
# multiple of 2 x CP = 4 (8, 4, 8), and the row's padding tail (4 tokens to 24) a segment of its own.
PADDED_ROW = torch.tensor([0, 8, 12, 20, 24], dtype=torch.int32)


def _row_mask(cu_seqlens: torch.Tensor, causal: bool) -> torch.Tensor:
    """[T, T] the block-diagonal mask of a packed row: True where row position i attends j."""
    total = int(cu_seqlens[-1])
    segment = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    mask = segment[:, None] == segment[None, :]
    return mask & torch.ones(total, total, dtype=torch.bool).tril() if causal else mask


def _kernel_mask(arguments: VarlenArguments, num_queries: int, num_keys: int, causal: bool) -> torch.Tensor:
    """[queries, keys] what a varlen kernel given ``arguments`` lets each query attend: query segment i
    against key segment i, causal with the diagonal at the bottom right (flash-attn's and torch's
    convention); keys by their row position (``key_rows``) where the keys handed in are picked rows."""
    cu_q, cu_k = arguments.cu_q.tolist(), arguments.cu_k.tolist()
    assert cu_q[0] == 0 and cu_q[-1] == num_queries and cu_q == sorted(cu_q), cu_q
    assert arguments.cu_q.dtype == arguments.cu_k.dtype == torch.int32
    q_lengths = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    k_lengths = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    assert (arguments.max_q, arguments.max_k) == (max(q_lengths), max(k_lengths))
    rows = arguments.key_rows if arguments.key_rows is not None else torch.arange(cu_k[-1])
    mask = torch.zeros(num_queries, num_keys, dtype=torch.bool)
    for q_start, q_length, k_start, k_length in zip(cu_q, q_lengths, cu_k, k_lengths):
        seen = torch.ones(q_length, k_length, dtype=torch.bool)
        if causal:  # query a sees key b iff b <= a + (k_length - q_length)
            seen = seen.tril(k_length - q_length)
        block = mask[q_start:q_start + q_length]
        block[:, rows[k_start:k_start + k_length]] = seen
    return mask


def _sdpa_mask(module: SDPACoreAttention, cu_seqlens: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """[queries, T] the mask SDPACoreAttention applies, read from its output: zero queries weigh every
    visible key alike, and value j is the one-hot of key j's row position, so output (i, j) > 0 exactly
    where query i sees key j."""
    total = int(cu_seqlens[-1])
    q = torch.zeros(len(held), HEADS, HEAD_DIM)
    k = torch.randn(len(held), GROUPS, HEAD_DIM)
    v = torch.eye(total)[held, None, :].expand(-1, GROUPS, -1).contiguous()  # [t, ng, T]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    out = module(q, k, v, None, packed_seq_params=params).reshape(len(held), HEADS, total)
    assert torch.equal(out[:, :1].expand_as(out) > 0, out > 0)  # every head alike
    return out[:, 0] > 0


@pytest.mark.parametrize("cu_seqlens", [PADDED_ROW, torch.tensor([0, 5, 8, 13, 14, 21], dtype=torch.int32)],
                         ids=["padded", "unpadded"])
@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask])
def test_varlen_arguments_of_a_packed_row_are_the_mask_sdpa_applies(cu_seqlens, mask_type):
    """One varlen call over the row: cu_seqlens as packed (no grouping by length) and the longest
    segment; the padding tail attends itself only."""
    causal = mask_type == AttnMaskType.causal
    total = int(cu_seqlens[-1])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    arguments = packed_varlen_arguments(params)
    kernel = _kernel_mask(arguments, total, total, causal)
    cpu = _sdpa_mask(_attention(mask_type), cu_seqlens, torch.arange(total))
    print(f"{total} tokens in {len(cu_seqlens) - 1} segments, max {arguments.max_q}: kernel mask "
          f"{int(kernel.sum())} pairs, SDPA's {int(cpu.sum())}, differing {int((kernel ^ cpu).sum())}")
    assert torch.equal(kernel, cpu)
    assert torch.equal(cpu, _row_mask(cu_seqlens, causal))


@pytest.mark.parametrize("cp_size", [2, 3])
def test_varlen_arguments_of_a_context_parallel_shard_are_the_mask_sdpa_applies(monkeypatch, cp_size):
    """Each CP rank: its query chunks against the row's keys each sees (the gathered row, picked by
    ``key_rows``), bottom-right causal; equal to what SDPA's CP path applies on CPU and to the rows of
    the whole row's causal block-diagonal mask the rank holds."""
    cu_seqlens = torch.tensor([0, 12, 24, 36], dtype=torch.int32) if cp_size == 3 else PADDED_ROW
    total = int(cu_seqlens[-1])
    for rank in range(cp_size):
        held = local_token_index(cu_seqlens, cp_size, rank)
        config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                   num_query_groups=GROUPS, attention_dropout=0.0, context_parallel_size=cp_size)
        sdpa = SDPACoreAttention(config, 1, AttnMaskType.causal, "self",
                                 pg_collection=type("Groups", (), {"cp": _Group(cp_size, rank)})())
        # The whole row's keys and one-hot values, as the CP all-gather would give them.
        row_k = torch.randn(total, GROUPS, HEAD_DIM)
        row_v = torch.eye(total)[:, None, :].expand(-1, GROUPS, -1).contiguous()
        monkeypatch.setattr(attention, "_gathered_keys_values", lambda key, value, cu, group: (row_k, row_v))
        cpu = _sdpa_mask(sdpa, cu_seqlens, held)
        arguments = context_varlen_arguments(cu_seqlens, cp_size, rank, "cpu")
        kernel = _kernel_mask(arguments, len(held), total, causal=True)
        print(f"CP {cp_size} rank {rank}: {len(held)} queries in {len(arguments.cu_q) - 1} chunks, max "
              f"{arguments.max_q} queries x {arguments.max_k} keys; differing pairs {int((kernel ^ cpu).sum())}")
        assert torch.equal(kernel, cpu)
        assert torch.equal(cpu, _row_mask(cu_seqlens, causal=True)[held])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel runs on CUDA only")
def test_varlen_packed_and_context_parallel_equal_sdpa_on_cuda(monkeypatch):
    """torch's varlen kernel (bf16) against SDPA per segment (fp32) on a padded row, and each CP 2
    rank's call against the rows of whole-row SDPA it holds."""
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=PADDED_ROW.cuda(), cu_seqlens_kv=PADDED_ROW.cuda(),
                             max_seqlen_q=8, max_seqlen_kv=8)
    q = torch.randn(24, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(24, GROUPS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    whole = _attention(AttnMaskType.causal)(q.float(), k.float(), v.float(), None, packed_seq_params=params)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, attention_dropout=0.0)
    packed = attention.VarlenCoreAttention(config, 1, AttnMaskType.causal, "self")(q, k, v, None,
                                                                                  packed_seq_params=params)
    worst = (packed.float() - whole).abs().max().item()
    print(f"packed row: varlen vs SDPA per segment {worst:.1e} (bf16)")
    assert worst < 3e-2
    monkeypatch.setattr(attention, "_gathered_keys_values", lambda key, value, cu, group: (k, v))
    for rank in range(2):
        cp_config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                      num_query_groups=GROUPS, attention_dropout=0.0, context_parallel_size=2)
        varlen = attention.VarlenCoreAttention(cp_config, 1, AttnMaskType.causal, "self",
                                               pg_collection=type("Groups", (), {"cp": _Group(2, rank)})())
        held = local_token_index(PADDED_ROW, 2, rank).cuda()
        worst = (varlen(q[held], k[held], v[held], None, packed_seq_params=params).float() - whole[held]).abs().max()
        print(f"CP rank {rank}: varlen chunks vs whole-row SDPA {worst.item():.1e} (bf16)")
        assert worst < 3e-2
