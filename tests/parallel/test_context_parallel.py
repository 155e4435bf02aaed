"""Context parallelism's token split and its collectives: which row positions each CP rank holds,
the gathered row in order with every rank's gradient summed back, the local query chunks and the
keys they see, and the core attention at CP 2 equal to CP 1 on a packed row (two gloo ranks)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from loongforge.models.layers.attention import SDPACoreAttention, context_chunks
from loongforge.parallel import mcore_patches
from loongforge.parallel.context_parallel import ContextShard, gather_row, local_token_index, row_order
from tests.models.helpers import free_port, limit_threads, run_workers

# A packed row of three samples (8, 4 and 12 tokens: multiples of 2 x CP = 4) and a padding tail (4).
ROW = torch.tensor([0, 8, 12, 24, 28], dtype=torch.int32)


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_sample():
    # CP 2: chunks of 2, 1, 3 and 1 tokens per sample; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert local_token_index(ROW, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23, 24, 27]
    assert local_token_index(ROW, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20, 25, 26]
    for cp in (1, 2):
        held = torch.cat([local_token_index(ROW, cp, rank) for rank in range(cp)])
        assert sorted(held.tolist()) == list(range(28))  # every token once
        assert torch.equal(held[row_order(ROW, cp)], torch.arange(28))


def test_a_sample_not_padded_to_2cp_is_refused_naming_the_padding():
    with pytest.raises(ValueError, match="padded to a multiple of 4 tokens; got segment lengths \\[6\\]"):
        local_token_index(torch.tensor([0, 8, 14], dtype=torch.int32), 2, 0)


def test_query_chunks_see_their_samples_keys_up_to_their_end():
    # Rank 1 of CP 2 on the first sample (8 tokens, chunks of 2): chunk 1 (row 2-3) sees keys 0-3,
    # chunk 2 (row 4-5) keys 0-5; locally they are rows 0-1 and 2-3.
    chunks = context_chunks(ROW, 2, 1)
    assert [(c.query_start, c.length, c.key_start, c.key_length) for c in chunks[:2]] == [(0, 2, 0, 4), (2, 2, 0, 6)]
    assert sum(c.length for c in chunks) == 14
    assert [(c.key_start, c.key_length) for c in chunks[4:6]] == [(12, 6), (12, 9)]


def test_a_shard_picks_its_tokens_and_the_features_of_its_placeholders():
    ids = torch.tensor([[5, 9, 9, 5, 9, 5, 5, 9]])  # placeholders (9) at 1, 2, 4 and 7
    shard = ContextShard(group=None, index=local_token_index(torch.tensor([0, 8]), 2, 1), row_input_ids=ids)
    assert shard.take(ids).tolist() == [[9, 5, 9, 5]]  # rank 1 holds positions 2, 3, 4, 5
    features = torch.arange(4.0)[:, None] * torch.ones(1, 3)  # [4 placeholders, 3]
    assert shard.local_features(features, 9)[:, 0].tolist() == [1.0, 2.0]  # placeholders 2 and 4


def _gathered_row_and_summed_gradient() -> None:
    rank = dist.get_rank()
    local = local_token_index(ROW, 2, rank).double()[:, None].repeat(1, 2).requires_grad_(True)  # [14, 2]
    row = gather_row(local, ROW, dist.group.WORLD)  # [28, 2]
    assert torch.equal(row[:, 0], torch.arange(28, dtype=torch.float64))
    # Each rank weighs the row differently (its own tokens' loss): the holder gets the sum of both.
    weights = torch.arange(56, dtype=torch.float64).reshape(28, 2) * (rank + 1)
    (row * weights).sum().backward()
    expected = 3 * torch.arange(56, dtype=torch.float64).reshape(28, 2)[local_token_index(ROW, 2, rank)]
    assert torch.equal(local.grad, expected)


def _attention(cp_group=None) -> SDPACoreAttention:
    """The core attention at the size of ``cp_group`` (None: CP 1)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                               kv_channels=4, context_parallel_size=1 if cp_group is None else cp_group.size(), params_dtype=torch.float64,
                               attention_dropout=0.0)
    pgs = type("Groups", (), {"cp": cp_group})()
    return SDPACoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=pgs)


def _attention_at_cp2_equals_cp1() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    rank = dist.get_rank()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=ROW, cu_seqlens_kv=ROW, max_seqlen_q=12, max_seqlen_kv=12)
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(28, 4, 4, dtype=torch.float64, generator=generator)  # [t, heads, hd]
    k, v = (torch.randn(28, 2, 4, dtype=torch.float64, generator=generator) for _ in range(2))  # GQA: 2 groups
    upstream = torch.randn(28, 16, dtype=torch.float64, generator=generator)
    whole = [x.clone().requires_grad_(True) for x in (q, k, v)]
    reference = _attention()
    out = reference(*whole, None, packed_seq_params=params)  # [28, 16]
    (out * upstream).sum().backward()
    held = local_token_index(ROW, 2, rank)
    mine = [x[held].clone().requires_grad_(True) for x in (q, k, v)]
    local_out = _attention(dist.group.WORLD)(*mine, None, packed_seq_params=params)  # [14, 16]
    (local_out * upstream[held]).sum().backward()
    worst = (local_out - out[held]).abs().max().item()
    grads = max((a.grad - b.grad[held]).abs().max().item() for a, b in zip(mine, whole))
    print(f"rank {rank}: CP 2 vs CP 1 attention output {worst:.1e}, q/k/v gradients {grads:.1e}")
    assert worst < 1e-12 and grads < 1e-12


def _worker(rank: int, port: int) -> None:
    limit_threads()
    mcore_patches.apply_cpu()  # megatron's collectives allocate on CUDA unless patched, as a CPU run is
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        _gathered_row_and_summed_gradient()
        _attention_at_cp2_equals_cp1()
    finally:
        dist.destroy_process_group()


def test_gathered_row_and_cp_attention_on_two_ranks():
    run_workers(_worker, 2, (free_port(),), timeout_s=120)
