"""Context parallelism for Gated DeltaNet: each CP rank runs the gated delta rule on its own chunks of every
sample and receives, from the other ranks, only what its chunks' starting states need.

Under CP a packed sample is cut into 2 x CP chunks and rank r holds chunks r and 2CP-1-r
(``parallel.context_parallel``). The rule is linear in the state it starts from: a chunk run from state S gives
``S_out = N + M S`` and outputs ``o = o_0 + O S`` per head, where N and o_0 are the chunk's own contribution
(run from zero) and M [d_k, d_k], O [C, d_k] its response to the incoming state. Each value column of the state
evolves alone (the delta rule reads and writes a key's column of values), so one run gives all four: the
values widened by d_k zero columns and the state started at [0 | I] (``transfer_run``). The ranks all-gather
every chunk's (N, M) (per chunk and head d_k x (d_v + d_k) numbers, independent of the chunk's length), each
composes a sample's states chunk by chunk in order, and adds ``O S_in`` to its chunks' outputs. Backward, the
gather's reduce-scatter returns to each rank the gradient of its chunks' (N, M) from every rank that used them.

The short causal convolution before the rule reads the K - 1 tokens before each of a rank's tokens, which
another rank may hold: the rank all-gathers the pre-convolution channels of the row and keeps, per own token,
its window of K tokens (``windowed_causal_conv1d``), so what autograd saves is K x the rank's tokens.

Compute: the rule runs on d_v + d_k value columns instead of d_v (2x at Qwen3.5's equal widths); memory and
the rule's work scale with the rank's share of the row, as attention's do under CP.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge.parallel.context_parallel import gather_row, local_token_index


def windowed_causal_conv1d(local: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                           group: dist.ProcessGroup) -> torch.Tensor:
    """``linear_attention.causal_conv1d`` of this CP rank's tokens: local [T/CP, C] (local order), weight
    [C, K] -> [T/CP, C], each token's window reaching into the tokens other ranks hold, never before its
    sample's start."""
    positions = local_token_index(cu_seqlens, group.size(), group.rank()).to(local.device)  # [T/CP]
    return conv_at(gather_row(local, cu_seqlens, group), positions, cu_seqlens, weight)


def conv_at(row: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The causal convolution (then SiLU) of the row [T, C] at row ``positions`` [P] -> [P, C]."""
    taps = weight.shape[-1]
    cu = cu_seqlens.to(row.device, torch.long)
    sample_start = cu[torch.searchsorted(cu, positions, right=True) - 1]  # [P]
    window = positions[:, None] - (taps - 1) + torch.arange(taps, device=row.device)  # [P, K]
    inside = (window >= sample_start[:, None]).to(row.dtype)  # [P, K]
    taken = row[window.clamp(min=0)] * inside[..., None]  # [P, K, C]
    return F.silu(torch.einsum("pkc,ck->pc", taken, weight))


def transfer_run(rule: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, chunk_seqlens: torch.Tensor):
    """The rule on each chunk of ``chunk_seqlens`` from the state [0 | I]: (own outputs o_0 [T, H_v, d_v], state
    responses O [T, H_v, d_k], (N | M) [n, H_v, d_k, d_v + d_k]: own last states and transfers)."""
    d_k, d_v, heads = k.shape[-1], v.shape[-1], v.shape[1]
    chunks = chunk_seqlens.numel() - 1
    widened = torch.cat([v, v.new_zeros(*v.shape[:-1], d_k)], dim=-1)  # [T, H_v, d_v + d_k]
    start = torch.cat([v.new_zeros(d_k, d_v, dtype=torch.float32), torch.eye(d_k, device=v.device)], dim=-1)
    start = start.expand(chunks, heads, d_k, d_v + d_k)  # [n, H_v, d_k, d_v + d_k]
    out, last = rule(q, k, widened, g, beta, chunk_seqlens, initial_state=start, output_final_state=True)
    return out[..., :d_v], out[..., d_v:], last


def local_chunk_lengths(cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
    """[2n] the lengths of a CP rank's chunks in local order (per sample: chunk r, chunk 2CP-1-r)."""
    return ((cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long) // (2 * cp)).repeat_interleave(2)


def context_parallel_rule(rule: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The rule over this CP rank's tokens (q, k [T/CP, H_k, d_k], v [T/CP, H_v, d_v], g, beta [T/CP, H_v], local
    order) of the row ``cu_seqlens`` describes, each sample's state carried across all its chunks ->
    [T/CP, H_v, d_v], what the rule gives these tokens on the whole row."""
    chunk_lengths = local_chunk_lengths(cu_seqlens, group.size())
    chunk_seqlens = F.pad(chunk_lengths.cumsum(0), (1, 0)).to(cu_seqlens.dtype)
    own, response, transfers = transfer_run(rule, q, k, v, g, beta, chunk_seqlens)
    every = in_sample_order(_all_gathered(transfers, group), group.size())
    return outputs_from_states(own, response, every, group.rank(), chunk_lengths)


def _all_gathered(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[m, ...] on each rank -> [CP * m, ...] in rank order; backward, each rank gets the summed gradient of its
    own rows."""
    # lazy: megatron-core's autograd collectives, only where CP runs
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(local.contiguous(), tensor_parallel_output_grad=True, group=group)


def in_sample_order(by_rank: torch.Tensor, cp: int) -> torch.Tensor:
    """[CP * 2n, ...] every rank's chunks in rank order (each rank's per sample: chunk r, chunk 2CP-1-r) ->
    [n, 2CP, ...], each sample's chunks in order."""
    by_rank = by_rank.reshape(cp, -1, 2, *by_rank.shape[1:])  # [CP, n, 2, ...]
    holders = [(index, 0) if index < cp else (2 * cp - 1 - index, 1) for index in range(2 * cp)]
    return torch.stack([by_rank[holder, :, slot] for holder, slot in holders], dim=1)


def outputs_from_states(own: torch.Tensor, response: torch.Tensor, every: torch.Tensor, rank: int,
                        chunk_lengths: torch.Tensor) -> torch.Tensor:
    """This rank's outputs [T/CP, H_v, d_v]: its chunks' own outputs plus their responses to the states the
    samples' earlier chunks leave (``every`` [n, 2CP, H_v, d_k, d_v + d_k]: every chunk's N | M)."""
    d_v, cp = own.shape[-1], every.shape[1] // 2
    starts = _starting_states(every[..., :d_v], every[..., d_v:])  # [n, 2CP, H_v, d_k, d_v]
    mine = starts[:, [rank, 2 * cp - 1 - rank]].flatten(0, 1)  # [2n, H_v, d_k, d_v], local chunk order
    sizes = chunk_lengths.tolist()
    pieces = [own_c + torch.einsum("thk,hkv->thv", response_c, state.to(own_c.dtype))
              for own_c, response_c, state in zip(own.split(sizes), response.split(sizes), mine)]
    return torch.cat(pieces)


def _starting_states(last: torch.Tensor, transfer: torch.Tensor) -> torch.Tensor:
    """Every chunk's starting state from every chunk's (N, M) [n, 2CP, H_v, d_k, d_v | d_k]: a sample starts
    from zero, and chunk j + 1 from N_j + M_j S_j."""
    state = torch.zeros_like(last[:, 0])  # [n, H_v, d_k, d_v]
    starts = []
    for index in range(last.shape[1]):
        starts.append(state)
        state = last[:, index] + transfer[:, index] @ state
    return torch.stack(starts, dim=1)
