"""SDPA core attention: packed segments, GQA, causality."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.models.layers.attention import SDPACoreAttention

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
    from loongforge.models.layers import attention
    from loongforge.parallel.context_parallel import local_token_index

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
