"""``training.compile``'s parts, eager against compiled: each part's function at a packed row's shapes, its
output and input gradients against eager in float64, and the milliseconds of forward + backward of each.

The CPU test (tests/models/test_compiled.py) and the GPU check's step ``j_compile`` (scripts/gpu_check.py)
measure with it; docs/benchmarks/compile.md records the figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.moe import moe_utils

from loongforge.models.layers import compiled, grouped_experts, layer_backend

CASES = ("norm", "rope", "swiglu", "grouped_swiglu", "permute")
# A weight's gradient sums a product over every token: inductor's fp32 reduction runs in another order than
# eager's (the norm's weight: 1.4e-6 of the largest at 1,024 tokens on the CPU, eager 1.2e-7).
SUMMED_OVER_TOKENS = {"norm": (1,)}  # which inputs of a case are such weights


@dataclass(frozen=True)
class Shape:
    hidden: int = 256
    heads: int = 4
    head_dim: int = 64
    ffn: int = 512
    experts: int = 8
    topk: int = 2


# Qwen2.5-7B's block (the GPU check) and Qwen3-30B-A3B's router (128 experts, top-8).
GPU_SHAPE = Shape(hidden=3584, heads=28, head_dim=128, ffn=18944, experts=128, topk=8)


@dataclass(frozen=True)
class Case:
    eager: Callable
    compiled: Callable
    inputs: list  # tensors that take gradients
    extra: tuple = ()  # other arguments


def _eager_swiglu(y: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * up


def _round_trip(permute: Callable, unpermute: Callable, routing: torch.Tensor) -> Callable:
    """Tokens [T, H] to expert order and back, weighted by probs [T, E]: the dispatcher's permute and the
    combine's unpermute."""
    def run(tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        permuted, permuted_probs, mapping = permute(tokens, routing, probs=probs)  # [T * k, H], [T * k], [T * k]
        return unpermute(permuted * permuted_probs.unsqueeze(-1), mapping, tokens.shape, probs=probs,
                         routing_map=routing)  # [T, H]
    return run


def cases(tokens: int, shape: Shape = Shape(), device: torch.device | str = "cpu",
          dtype: torch.dtype = torch.float32) -> dict[str, Case]:
    """Each part's eager and compiled function (the patch's own wrapper around the same original) at ``tokens``."""
    generator = torch.Generator().manual_seed(tokens)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(device, dtype)

    routing = torch.zeros(tokens, shape.experts, dtype=torch.bool)  # [T, E], topk experts per token
    choice = torch.rand(tokens, shape.experts, generator=generator).topk(shape.topk, dim=-1).indices
    routing = routing.scatter_(1, choice, True).to(device)
    wrap = {patch.attribute: patch.wrap for part in compiled.PARTS for patch in compiled.PATCHES[part]}
    norm, rope = layer_backend.rms_norm, rope_utils._apply_rotary_pos_emb_bshd
    permute, unpermute = moe_utils.permute, moe_utils.unpermute
    return {
        "norm": Case(norm, wrap["rms_norm"](norm), [rand(tokens, 1, shape.hidden), rand(shape.hidden)], (1e-6,)),
        "rope": Case(rope, wrap["_apply_rotary_pos_emb_bshd"](rope), [rand(tokens, 1, shape.heads, shape.head_dim)],
                     (rand(tokens, 1, 1, shape.head_dim),)),
        # megatron's compiled SwiGLU (what the part switches its MLPs to) against its eager closure's math.
        "swiglu": Case(_eager_swiglu, lambda y: bias_swiglu_impl(y, None), [rand(tokens, 1, 2 * shape.ffn)]),
        "grouped_swiglu": Case(grouped_experts.swiglu, wrap["swiglu"](grouped_experts.swiglu),
                               [rand(tokens, 2 * shape.ffn)]),
        "permute": Case(_round_trip(permute, unpermute, routing),
                        _round_trip(wrap["permute"](permute), wrap["unpermute"](unpermute), routing),
                        [rand(tokens, shape.hidden), rand(tokens, shape.experts)]),
    }


def run(function: Callable, inputs: list[torch.Tensor], extra: tuple) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward and backward (against fixed random weights); the output and the inputs' gradients."""
    leaves = [tensor.detach().clone().requires_grad_() for tensor in inputs]
    output = function(*leaves, *extra)
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(7)).to(output.device, output.dtype)
    (output * weights).sum().backward()
    return output.detach(), [leaf.grad for leaf in leaves]


def relative(ours: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference over the largest magnitude (at least 1)."""
    ours, expected = ours.double().cpu(), expected.double().cpu()
    return float((ours - expected).abs().max() / expected.abs().max().clamp(min=1.0))


def milliseconds(function: Callable, inputs: list[torch.Tensor], extra: tuple, repeats: int = 20) -> float:
    run(function, inputs, extra)  # warm (and compiled)
    synchronize = torch.cuda.synchronize if inputs[0].is_cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        run(function, inputs, extra)
    synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def measure(part: str, tokens: int, shape: Shape = Shape(), device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, repeats: int = 20) -> dict:
    """One part at one row length: ``first_call_s`` (compiling included), ``eager_ms`` / ``compiled_ms`` (forward +
    backward), ``worst`` / ``eager_worst`` (compiled / eager against eager in float64, outputs and input gradients)
    and ``worst_summed`` (weight gradients summed over the tokens, ``SUMMED_OVER_TOKENS``)."""
    case = cases(tokens, shape, device, dtype)[part]
    start = time.perf_counter()
    ours, grads = run(case.compiled, case.inputs, case.extra)
    first_call_s = time.perf_counter() - start
    exact, exact_grads = run(case.eager, [t.double() for t in case.inputs],
                             tuple(a.double() if isinstance(a, torch.Tensor) else a for a in case.extra))
    expected, expected_grads = run(case.eager, case.inputs, case.extra)
    summed = SUMMED_OVER_TOKENS.get(part, ())
    held = [i for i in range(len(grads)) if i not in summed]
    return {"part": part, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."), "first_call_s": first_call_s,
            "worst": max([relative(ours, exact)] + [relative(grads[i], exact_grads[i]) for i in held]),
            "eager_worst": max([relative(expected, exact)] + [relative(expected_grads[i], exact_grads[i]) for i in held]),
            "worst_summed": max([0.0] + [relative(grads[i], exact_grads[i]) for i in summed]),
            "eager_ms": milliseconds(case.eager, case.inputs, case.extra, repeats),
            "compiled_ms": milliseconds(case.compiled, case.inputs, case.extra, repeats)}


def line(result: dict) -> str:
    return (f"{result['part']} at {result['tokens']} tokens ({result['dtype']}): eager {result['eager_ms']:.3f} ms, "
            f"compiled {result['compiled_ms']:.3f} ms fwd+bwd (x{result['eager_ms'] / result['compiled_ms']:.2f}; "
            f"first call {result['first_call_s']:.1f} s); vs fp64 {result['worst']:.1e} (eager {result['eager_worst']:.1e})"
            f", summed weight gradients {result['worst_summed']:.1e}")
