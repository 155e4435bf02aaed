"""``training.compile``'s parts (``models.layers.compiled``) compute what eager computes: each compiled function's
output and input gradients, in fp32, equal the eager original's in fp64 (<= 1e-6 of the tensor's largest magnitude), and its time against eager is printed at
a few shapes (the CPU figures of docs/benchmarks/compile.md come from this test's output:
``pytest tests/models/test_compiled.py -s``)."""

from __future__ import annotations

import time

import pytest
import torch
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.moe import moe_utils

from loongforge.models.layers import compiled, grouped_experts, layer_backend
from loongforge.models.layers.compiled import PARTS, compile_parts

BOUND = 1e-6
# A weight's gradient sums a product over every token: inductor's fp32 reduction runs in another order than eager's
# (1.4e-6 of the largest at 1,024 tokens for the norm's weight, eager 1.2e-7); every output and input gradient is
# held to BOUND.
SUMMED_OVER_TOKENS = {"norm": (1,)}  # which inputs of _cases are such weights
SUMMED_BOUND = 5e-6
SHAPES = (64, 1024)  # tokens: a short and a long packed row (dynamic shapes: one graph for both)
HIDDEN, HEADS, HEAD_DIM, FFN, EXPERTS, TOPK = 256, 4, 64, 512, 8, 2


def _eager_swiglu(y: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(y, 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _cases(tokens: int) -> dict:
    """Per part: (eager function, compiled function, inputs that take gradients, other arguments)."""
    generator = torch.Generator().manual_seed(tokens)
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    routing = torch.zeros(tokens, EXPERTS, dtype=torch.bool)  # [T, E], TOPK experts per token
    routing.scatter_(1, torch.rand(tokens, EXPERTS, generator=generator).topk(TOPK, dim=-1).indices, True)
    patched = {patch.attribute: patch.wrap for part in PARTS for patch in compiled.PATCHES[part]}
    norm, rope = layer_backend.rms_norm, rope_utils._apply_rotary_pos_emb_bshd
    return {
        "norm": (norm, patched["rms_norm"](norm), [rand(tokens, 1, HIDDEN), rand(HIDDEN)], (1e-6,)),
        "rope": (rope, patched["_apply_rotary_pos_emb_bshd"](rope), [rand(tokens, 1, HEADS, HEAD_DIM)],
                 (rand(tokens, 1, 1, HEAD_DIM),)),
        # megatron's compiled SwiGLU (what the part switches its MLPs to) against its eager closure's math.
        "swiglu": (_eager_swiglu, lambda y: bias_swiglu_impl(y, None), [rand(tokens, 1, 2 * FFN)], ()),
        "grouped_swiglu": (grouped_experts.swiglu, patched["swiglu"](grouped_experts.swiglu),
                           [rand(tokens, 2 * FFN)], ()),
        "permute": (_round_trip(moe_utils.permute, moe_utils.unpermute, routing),
                    _round_trip(patched["permute"](moe_utils.permute), patched["unpermute"](moe_utils.unpermute),
                                routing),
                    [rand(tokens, HIDDEN), rand(tokens, EXPERTS)], ()),
    }


def _round_trip(permute, unpermute, routing: torch.Tensor):
    """Tokens [T, H] to expert order and back, weighted by probs [T, E]: the dispatcher's permute and the
    combine's unpermute."""
    def run(tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        permuted, permuted_probs, mapping = permute(tokens, routing, probs=probs)  # [T * k, H], [T * k], [T * k]
        return unpermute(permuted * permuted_probs.unsqueeze(-1), mapping, tokens.shape, probs=probs,
                         routing_map=routing)  # [T, H]
    return run


def _relative(ours: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference over the largest magnitude (at least 1): a norm weight's gradient sums over 1,024
    tokens, which fp32 rounds (1.4e-4 apart near 100 between fused and eager sums; so the reference is fp64)."""
    return float((ours.double() - expected.double()).abs().max() / expected.double().abs().max().clamp(min=1.0))


def _run(function, inputs: list[torch.Tensor], extra: tuple) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [tensor.clone().requires_grad_() for tensor in inputs]
    output = function(*leaves, *extra)
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(7))
    (output * weights).sum().backward()
    return output.detach(), [leaf.grad for leaf in leaves]


def _milliseconds(function, inputs: list[torch.Tensor], extra: tuple, repeats: int = 20) -> float:
    _run(function, inputs, extra)  # warm (and compiled)
    start = time.perf_counter()
    for _ in range(repeats):
        _run(function, inputs, extra)
    return (time.perf_counter() - start) / repeats * 1e3


def test_auto_compiles_on_cuda_only():
    assert compile_parts("auto", torch.device("cpu")) == ()
    assert compile_parts("auto", torch.device("cuda")) == PARTS
    assert compile_parts("on", torch.device("cpu")) == PARTS and compile_parts("off", torch.device("cuda")) == ()


@pytest.mark.parametrize("part", ["norm", "rope", "swiglu", "grouped_swiglu", "permute"])
def test_compiled_part_equals_eager_forward_and_gradient(part):
    lines, worst, eager_worst, worst_summed = [], 0.0, 0.0, 0.0
    for tokens in SHAPES:
        eager, fast, inputs, extra = _cases(tokens)[part]
        compile_start = time.perf_counter()
        ours, grads = _run(fast, inputs, extra)
        compile_s = time.perf_counter() - compile_start
        # The reference: eager in float64; fp32 eager's own distance from it is printed beside.
        exact, exact_grads = _run(eager, [tensor.double() for tensor in inputs],
                                  tuple(a.double() if isinstance(a, torch.Tensor) else a for a in extra))
        expected, expected_grads = _run(eager, inputs, extra)
        summed = SUMMED_OVER_TOKENS.get(part, ())
        worst = max([worst, _relative(ours, exact)] +
                    [_relative(g, e) for i, (g, e) in enumerate(zip(grads, exact_grads)) if i not in summed])
        worst_summed = max([worst_summed] + [_relative(grads[i], exact_grads[i]) for i in summed])
        eager_worst = max([eager_worst, _relative(expected, exact)] +
                          [_relative(g, e) for g, e in zip(expected_grads, exact_grads)])
        lines.append(f"{tokens} tokens: eager {_milliseconds(eager, inputs, extra):.3f} ms, compiled "
                     f"{_milliseconds(fast, inputs, extra):.3f} ms (fwd+bwd; first call {compile_s:.1f} s)")
    print(f"\n{part}: compiled fp32 vs eager fp64, output and gradients within {worst:.1e} of their largest "
          f"(asserted {BOUND:.0e}; eager fp32 {eager_worst:.1e}); weight gradients summed over the tokens "
          f"{worst_summed:.1e} (asserted {SUMMED_BOUND:.0e}); " + "; ".join(lines))
    assert worst <= BOUND and worst_summed <= SUMMED_BOUND
