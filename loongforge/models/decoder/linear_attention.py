"""The gated delta rule (Gated DeltaNet's linear attention, Qwen3.5's and Qwen3-Next's) in plain torch, for
packed rows: every device, no kernel library; the recurrent state restarts at each sample boundary.

Per head, with a state ``S`` [d_k, d_v] that maps keys to values, each token ``t`` of a sample does::

    S <- exp(g_t) * S                               decay
    S <- S + beta_t * k_t (v_t - S^T k_t)^T          delta rule: move k_t's value towards v_t
    o_t = S^T q_t                                    read

with ``q``, ``k`` L2-normalised (when asked) and ``q`` scaled by 1 / sqrt(d_k). ``recurrent`` does exactly
this, token by token (the reference); ``chunked`` computes the same in chunks of ``chunk_size`` tokens: inside
a chunk the updates are solved at once (a unit lower-triangular system: the delta rule's corrections of
each token by the earlier ones), across chunks the state carries the decayed sum. Both take rows packed
with ``cu_seqlens`` and run each sample from a zero state, so no state leaks from one sample into the next;
given ``initial_state`` [n, H_v, d_k, d_v], segment i starts from its state instead, and
``output_final_state`` also returns each segment's last state (context parallelism carries a sample's state
across the CP ranks' chunks of it: ``models.decoder.linear_attention_cp``).

Shapes: q, k [T, H_k, d_k]; v [T, H_v, d_v]; g, beta [T, H_v] (g a log decay, <= 0); H_v a multiple of H_k
(each key head serves H_v / H_k consecutive value heads). Output [T, H_v, d_v], computed in fp32 and
returned in v's dtype.

Gated DeltaNet runs a short causal convolution over its q, k, v projections first (``causal_conv1d``):
depthwise, each channel over its last ``K`` tokens, which must not reach into the previous sample either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _prepared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, l2_normalize: bool):
    """fp32 [H_v, T, d] views of q (normalised, scaled), k (normalised) and v."""
    groups = v.shape[1] // k.shape[1]
    q, k = (x.float().repeat_interleave(groups, dim=1) for x in (q, k))  # [T, H_v, d_k]
    if l2_normalize:
        q, k = l2_normalized(q), l2_normalized(k)
    q = q * q.shape[-1] ** -0.5
    return q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1)  # [H_v, T, d]


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last axis: fla's (and transformers') form, eps inside the root, which
    differs from clamping the norm where |x| is small (a freshly initialised model's q and k are)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _segments(cu_seqlens: torch.Tensor | None, length: int) -> list[tuple[int, int]]:
    bounds = [0, length] if cu_seqlens is None else cu_seqlens.tolist()
    return [(start, end) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]


def _first_states(initial_state: torch.Tensor | None, count: int, v: torch.Tensor, d_k: int) -> list[torch.Tensor]:
    """Each segment's starting state [H_v, d_k, d_v] in fp32: ``initial_state``'s, else zeros."""
    if initial_state is None:
        return [v.new_zeros(v.shape[0], d_k, v.shape[-1]) for _ in range(count)]
    if initial_state.shape[0] != count:
        raise ValueError(f"initial_state holds {initial_state.shape[0]} states for {count} segments")
    return list(initial_state.float().unbind(0))


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              cu_seqlens: torch.Tensor | None = None, l2_normalize: bool = True,
              initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """The rule token by token (the reference ``chunked`` is checked against)."""
    dtype = v.dtype
    q, k, v = _prepared(q, k, v, l2_normalize)
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)  # [H_v, T]
    out = torch.zeros_like(v)  # [H_v, T, d_v]
    segments = _segments(cu_seqlens, v.shape[1])
    finals = []
    for (start, end), state in zip(segments, _first_states(initial_state, len(segments), v, k.shape[-1])):
        for t in range(start, end):  # state [H_v, d_k, d_v]
            state = state * g[:, t, None, None].exp()
            error = v[:, t] - torch.einsum("hkv,hk->hv", state, k[:, t])  # [H_v, d_v]
            state = state + beta[:, t, None, None] * k[:, t, :, None] * error[:, None, :]
            out[:, t] = torch.einsum("hkv,hk->hv", state, q[:, t])
        finals.append(state)
    out = out.transpose(0, 1).to(dtype)
    return (out, torch.stack(finals)) if output_final_state else out


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            cu_seqlens: torch.Tensor | None = None, l2_normalize: bool = True, chunk_size: int = 64,
            initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """The rule in chunks of ``chunk_size`` tokens, each sample of the packed row from a zero state (or its
    ``initial_state``); with ``output_final_state``, (output, the segments' last states [n, H_v, d_k, d_v])."""
    dtype = v.dtype
    q, k, v = _prepared(q, k, v, l2_normalize)
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)  # [H_v, T]
    # The row is cut into its chunks once (``split``) and their outputs joined once (``cat``): slicing each
    # chunk out, or writing each into a preallocated row, would make autograd build a whole row's gradient
    # per chunk (quadratic in the row's length).
    segments = _segments(cu_seqlens, v.shape[1])
    chunks = [(first, min(first + chunk_size, end)) for start, end in segments
              for first in range(start, end, chunk_size)]
    first_states = dict(zip((start for start, _ in segments),
                            _first_states(initial_state, len(segments), v, k.shape[-1])))
    sizes = [end - first for first, end in chunks]
    pieces, finals, state = [], [], None
    for (first, _), q_c, k_c, v_c, g_c, beta_c in zip(chunks, *(x.split(sizes, dim=1) for x in (q, k, v, g, beta))):
        if first in first_states:  # a new sample: its first state [H_v, d_k, d_v]
            if state is not None:
                finals.append(state)
            state = first_states[first]
        out, state = _chunk(q_c, k_c, v_c, g_c, beta_c, state)
        pieces.append(out)
    finals.append(state)
    out = torch.cat(pieces, dim=1).transpose(0, 1).to(dtype)
    return (out, torch.stack(finals)) if output_final_state else out


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of C tokens from ``state`` [H, d_k, d_v]: (outputs [H, C, d_v], the state after it).

    With the chunk's cumulative log decay ``G_i`` (so the decay from token j to token i is exp(G_i - G_j)),
    token i's correction ``u_i = beta_i (v_i - S~_i^T k_i)`` reads the decayed state
    ``S~_i = exp(G_i) S_0 + sum_{j<i} exp(G_i - G_j) k_j u_j^T``, so all of them at once solve
    ``(I + L) u = beta (v - exp(G) k S_0)`` with ``L_ij = beta_i exp(G_i - G_j) k_i.k_j`` for j < i."""
    length = q.shape[1]
    decay = g.cumsum(dim=-1)  # [H, C]: G_i
    relative = decay[:, :, None] - decay[:, None, :]  # [H, C, C]: G_i - G_j
    below = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-1)  # j < i
    upto = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()  # j <= i
    # exp only where j <= i: above the diagonal G_i - G_j > 0 could overflow.
    weights = torch.where(upto, relative, torch.full_like(relative, float("-inf"))).exp()  # [H, C, C]
    keys = k @ k.transpose(1, 2)  # [H, C, C]: k_i . k_j
    lower = beta[:, :, None] * keys * weights * below  # [H, C, C]: L_ij
    target = beta[:, :, None] * (v - decay.exp()[:, :, None] * (k @ state))  # [H, C, d_v]
    identity = torch.eye(length, dtype=q.dtype, device=q.device).expand_as(lower)
    corrections = torch.linalg.solve_triangular(identity + lower, target, upper=False, unitriangular=True)
    # o_i = exp(G_i) q_i^T S_0 + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j
    scores = (q @ k.transpose(1, 2)) * weights * upto  # [H, C, C]
    out = decay.exp()[:, :, None] * (q @ state) + scores @ corrections
    # S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T
    tail = (decay[:, -1:] - decay).exp()  # [H, C]
    state = decay[:, -1, None, None].exp() * state + (k * tail[:, :, None]).transpose(1, 2) @ corrections
    return out, state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution of a packed row, then SiLU: x [T, C], weight [C, K] (K taps, the last
    one on the token itself), bias [C] -> [T, C]. Each sample starts from zeros, as if alone."""
    taps = weight.shape[-1]
    sizes = [end - start for start, end in _segments(cu_seqlens, x.shape[0])]
    pieces = []
    for sample in x.split(sizes):  # one split: slicing each sample would cost a whole row's gradient each
        padded = F.pad(sample.transpose(0, 1)[None], (taps - 1, 0))  # [1, C, K - 1 + L]
        pieces.append(F.conv1d(padded, weight[:, None], bias, groups=x.shape[1])[0].transpose(0, 1))
    return F.silu(torch.cat(pieces))


def fla_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None, l2_normalize: bool = True,
                initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """``chunked`` on fla's Triton kernel (GPU): the same arguments and result. Each key head is repeated
    over the value heads it serves first, as megatron-core's Gated DeltaNet calls the kernel."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # lazy: GPU-only, the ``gpu`` extra

    groups = v.shape[1] // k.shape[1]
    q, k = (x.repeat_interleave(groups, dim=1) for x in (q, k))
    segments = None if cu_seqlens is None else cu_seqlens.to(torch.long)
    out, final = chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None].float(), beta=beta[None],
                                        cu_seqlens=segments, use_qk_l2norm_in_kernel=l2_normalize,
                                        initial_state=initial_state, output_final_state=output_final_state)
    out = out[0].to(v.dtype)
    return (out, final) if output_final_state else out
