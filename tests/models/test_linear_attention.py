"""The gated delta rule in plain torch (``models.decoder.linear_attention``): the chunked form equals the token-by-token
rule and transformers' own torch references of Qwen3.5's Gated DeltaNet (``torch_recurrent_gated_delta_rule``,
``torch_chunk_gated_delta_rule``) on each sample; a packed row of three samples gives each sample what it gives
alone, which fails if the recurrent state crosses a sample boundary (the row run as one sample differs)."""

from __future__ import annotations

import functools

import torch

from loongforge.models.decoder.linear_attention import causal_conv1d, chunked, recurrent
from loongforge.models.decoder.linear_attention_cp import (
    conv_at,
    in_sample_order,
    local_chunk_lengths,
    outputs_from_states,
    transfer_run,
)
from loongforge.parallel.context_parallel import local_token_index

TOLERANCE = 1e-5
LENGTHS = (37, 70, 5)  # a chunk boundary inside the first two samples at chunk size 16, a short last one
HEADS_K, HEADS_V, DIM_K, DIM_V = 2, 4, 16, 8  # grouped: each key head serves two value heads


def inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(length, HEADS_K, DIM_K, generator=generator) for _ in range(2))
    v = torch.randn(length, HEADS_V, DIM_V, generator=generator)
    g = -torch.rand(length, HEADS_V, generator=generator)  # log decays in (-1, 0]
    beta = torch.rand(length, HEADS_V, generator=generator)
    return q, k, v, g, beta


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def test_chunked_equals_the_rule_and_transformers_on_each_sample():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    worst = 0.0
    for seed, length in enumerate(LENGTHS):
        q, k, v, g, beta = inputs(length, seed)
        ours = chunked(q, k, v, g, beta, chunk_size=16)  # [T, H_v, d_v]
        batched = [x[None] for x in (q, k, v, g, beta)]  # transformers' [1, T, H, d]
        references = [recurrent(q, k, v, g, beta),
                      torch_recurrent_gated_delta_rule(*batched, use_qk_l2norm_in_kernel=True)[0][0],
                      torch_chunk_gated_delta_rule(*batched, use_qk_l2norm_in_kernel=True, chunk_size=16)[0][0]]
        worst = max(worst, *(relative(ours, reference) for reference in references))
    print(f"\nchunked vs the rule and transformers' references: {worst:.1e}")
    assert worst <= TOLERANCE


def test_a_packed_row_gives_each_sample_what_it_gives_alone():
    samples = [inputs(length, seed) for seed, length in enumerate(LENGTHS)]
    row = [torch.cat(parts) for parts in zip(*samples)]
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    alone = torch.cat([chunked(*sample, chunk_size=16) for sample in samples])
    packed = chunked(*row, cu_seqlens=cu_seqlens, chunk_size=16)
    leaked = chunked(*row, chunk_size=16)  # the row as one sample: the state runs on across boundaries
    worst, crossing = relative(packed, alone), relative(leaked[LENGTHS[0]:], alone[LENGTHS[0]:])
    print(f"\npacked vs alone: {worst:.1e}; with the state carried across boundaries: {crossing:.1e}")
    assert worst <= TOLERANCE and crossing > 1e-2
    assert relative(recurrent(*row, cu_seqlens=cu_seqlens), alone) <= TOLERANCE


def test_gradients_of_the_chunked_form_equal_the_rule():
    q, k, v, g, beta = (x.requires_grad_() for x in inputs(40, 7))
    grads = []
    for function in (chunked, recurrent):
        for x in (q, k, v, g, beta):
            x.grad = None
        function(q, k, v, g, beta).square().sum().backward()
        grads.append([x.grad.clone() for x in (q, k, v, g, beta)])
    worst = max(relative(a, b) for a, b in zip(*grads))
    print(f"\ngradients, chunked vs the rule: {worst:.1e}")
    assert worst <= TOLERANCE


def test_the_convolution_of_a_packed_row_restarts_at_each_sample_like_transformers_layer():
    """Qwen3.5's Gated DeltaNet convolves its projections with ``nn.Conv1d(padding=K-1)`` cut to the
    sample's length, then SiLU: each sample of a packed row gets exactly that, nothing of the sample before."""
    channels, taps = 12, 4
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(channels, channels, taps, groups=channels, padding=taps - 1, bias=False)
    samples = [torch.randn(length, channels) for length in LENGTHS]
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        alone = torch.cat([torch.nn.functional.silu(conv(s.T[None])[0, :, :len(s)].T) for s in samples])
        packed = causal_conv1d(torch.cat(samples), conv.weight[:, 0], None, cu_seqlens)
        leaked = causal_conv1d(torch.cat(samples), conv.weight[:, 0])
    start = LENGTHS[0]
    print(f"\nconvolution, packed vs alone: {relative(packed, alone):.1e}; across boundaries: "
          f"{relative(leaked[start:start + taps], alone[start:start + taps]):.1e}")
    assert relative(packed, alone) <= TOLERANCE
    assert relative(leaked[start:start + taps], alone[start:start + taps]) > 1e-2


def _cp_row(seed: int = 0):
    """A packed row of three samples (lengths multiples of 2 x CP 2, one as short as a chunk a rank), the rule's
    inputs with gradients: q, k [T, 2, 8], v [T, 4, 6], g, beta [T, 4]."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [12, 4, 20]
    total = sum(lengths)
    q, k = (torch.randn(total, 2, 8, generator=generator) for _ in range(2))
    v = torch.randn(total, 4, 6, generator=generator)
    g = -torch.rand(total, 4, generator=generator)
    beta = torch.rand(total, 4, generator=generator)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return [x.requires_grad_() for x in (q, k, v, g, beta)], cu


def test_context_parallel_carries_each_samples_state_across_the_ranks_chunks():
    """CP 2 in one process (the all-gather is the ranks' chunks concatenated in rank order): every rank's
    outputs and the inputs' gradients equal the rule on the whole row (chunks of 3 tokens inside 3-, 1- and
    5-token CP chunks), to float32 rounding."""
    cp = 2
    inputs, cu = _cp_row()
    rule = functools.partial(chunked, chunk_size=3)
    whole = rule(*inputs, cu)  # [T, H_v, d_v]
    lengths = local_chunk_lengths(cu, cp)
    runs, index = [], [local_token_index(cu, cp, rank) for rank in range(cp)]
    for rank in range(cp):
        chunk_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        runs.append(transfer_run(rule, *(x[index[rank]] for x in inputs), chunk_seqlens))
    every = in_sample_order(torch.cat([transfers for _, _, transfers in runs]), cp)
    row = torch.empty_like(whole)
    for rank, (own, response, _) in enumerate(runs):
        row = row.index_put((index[rank],), outputs_from_states(own, response, every, rank, lengths))
    weights = torch.randn(whole.shape, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.grad((whole * weights).sum(), inputs)
    got = torch.autograd.grad((row * weights).sum(), inputs)
    out_error = float((row - whole).abs().max())
    grad_error = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, expected))
    print(f"\nCP 2: outputs within {out_error:.1e}, gradients within {grad_error:.1e} of the largest")
    assert out_error < 3e-6 and grad_error < 3e-6


def test_context_parallel_convolution_reads_the_window_other_ranks_hold():
    _, cu = _cp_row()
    generator = torch.Generator().manual_seed(2)
    x, weight = torch.randn(int(cu[-1]), 5, generator=generator), torch.randn(5, 4, generator=generator)
    whole = causal_conv1d(x, weight, None, cu)
    for rank in range(2):
        index = local_token_index(cu, 2, rank)
        assert torch.allclose(conv_at(x, index, cu, weight), whole[index], atol=1e-6)
