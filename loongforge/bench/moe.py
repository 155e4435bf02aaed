"""``loongforge bench moe``: grouped-GEMM experts against megatron's ``SequentialMLP`` on one MoE layer's experts.

Both modules are built with the same weights (``GroupedExperts`` holds ``SequentialMLP``'s parameters) at the
shapes given: Qwen3-30B-A3B's by default on CUDA (128 experts, top-8, hidden 2048, expert FFN 768, 8192 tokens,
bf16), a quarter of its widths on the CPU (128 experts, top-8, hidden 512, FFN 192, 1024 tokens, fp32), so the
per-expert loop keeps its length. The tokens are routed by random scores (top-k of a softmax), sorted by expert
as megatron's dispatcher sorts them; one timed step is the experts' forward and backward (every weight's
gradient). Also timed: stacking the expert weights, the copy ``GroupedExperts`` makes per forward on CUDA for
the grouped kernel (none on the CPU, whose loop reads each weight in place); and the largest difference
between the two modules' outputs, relative to the largest output.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ParallelConfig
from loongforge.models.layers.fp8 import device_name
from loongforge.models.layers.grouped_experts import GroupedExperts
from loongforge.models.layers.initialization import SeededSequentialMLP
from loongforge.parallel.distributed import init_distributed, init_model_parallel, shutdown
from loongforge.train.runner import library_versions


@dataclass(frozen=True)
class MoeShape:
    experts: int
    topk: int
    hidden: int
    ffn: int  # each expert's SwiGLU width
    tokens: int  # tokens of the layer's input; tokens * topk rows reach the experts


# Qwen3-30B-A3B's sparse layer; the CPU default keeps its experts and top-k at a quarter of its widths and
# an eighth of its tokens (a step in seconds on one core).
QWEN3_30B_A3B = MoeShape(experts=128, topk=8, hidden=2048, ffn=768, tokens=8192)
CPU_SHAPE = MoeShape(experts=128, topk=8, hidden=512, ffn=192, tokens=1024)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def expert_config(shape: MoeShape, dtype: torch.dtype, device: torch.device) -> TransformerConfig:
    """The decoder's expert settings (SwiGLU, no biases, megatron's unfused activation) at ``shape``, the weights
    allocated on ``device`` and left for ``time_experts`` to draw (megatron's CPU initialisation of 128 experts at
    Qwen3-30B-A3B's widths, 0.6 B parameters per module, would outlast the bench)."""
    return TransformerConfig(perform_initialization=False, use_cpu_initialization=device.type == "cpu", num_layers=1, hidden_size=shape.hidden, num_attention_heads=8,
                             num_moe_experts=shape.experts, moe_router_topk=shape.topk,
                             moe_ffn_hidden_size=shape.ffn, ffn_hidden_size=shape.ffn, gated_linear_unit=True,
                             activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
                             params_dtype=dtype, bf16=dtype == torch.bfloat16, gradient_accumulation_fusion=False)


def routed_rows(shape: MoeShape, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(rows [T*k, H] in expert order, tokens_per_expert [E] on the host, probs [T*k]) from random routing."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(shape.tokens, shape.experts, generator=g).softmax(-1)  # [T, E]
    probs, chosen = scores.topk(shape.topk, dim=-1)  # [T, k]
    order = chosen.flatten().argsort(stable=True)  # the dispatcher's sort: rows grouped by expert
    tokens_per_expert = torch.bincount(chosen.flatten(), minlength=shape.experts)  # [E]
    hidden = torch.randn(shape.tokens, shape.hidden, generator=g)  # [T, H]
    rows = hidden.repeat_interleave(shape.topk, dim=0)[order]  # [T*k, H]
    return rows.to(device, dtype), tokens_per_expert, probs.flatten()[order].to(device, torch.float32)


def _median_ms(steps_by_name: dict[str, Callable[[], None]], steps: int, warmup: int,
               device: torch.device) -> dict[str, float]:
    """The median milliseconds of each step, the steps taking turns (a machine's drift, another process's load,
    reaches every module alike)."""
    times: dict[str, list[float]] = {name: [] for name in steps_by_name}
    for index in range(warmup + steps):
        for name, step in steps_by_name.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if index >= warmup:
                times[name].append(1000 * (time.perf_counter() - start))
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def time_experts(shape: MoeShape, *, device: torch.device, dtype: torch.dtype, steps: int, warmup: int,
                 log: Callable[[str], None] = lambda _: None) -> dict:
    """Both expert modules at ``shape`` on ``device`` (megatron's parallel state at EP = TP = 1): the median
    milliseconds of a forward + backward each, of the weight stacking, and their outputs' relative difference."""
    config = expert_config(shape, dtype, device)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    sequential = SeededSequentialMLP(shape.experts, config, submodules, pg_collection=groups)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for weight in sequential.parameters():
            weight.normal_(0.0, 0.02, generator=generator)
    grouped = GroupedExperts(shape.experts, config, submodules, pg_collection=groups)
    grouped.load_state_dict(sequential.state_dict())
    rows, tokens_per_expert, probs = routed_rows(shape, device, dtype)
    outputs = {}

    def step(name: str, module: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            module.zero_grad(set_to_none=True)
            output, _ = module(rows, tokens_per_expert, probs)  # [T*k, H]
            output.backward(torch.ones_like(output))
            outputs[name] = output.detach()
        return run

    def stack() -> None:
        for name in ("linear_fc1", "linear_fc2"):
            torch.stack([getattr(expert, name).weight.detach() for expert in grouped.local_experts])

    timed = _median_ms({"sequential": step("sequential", sequential), "grouped": step("grouped", grouped),
                        "stack": stack}, steps, warmup, device)
    log(f"sequential {timed['sequential']:.2f} ms, grouped {timed['grouped']:.2f} ms per forward+backward")
    reference = outputs["sequential"].float()
    return {"sequential_ms": timed["sequential"], "grouped_ms": timed["grouped"],
            "speedup": timed["sequential"] / timed["grouped"], "stack_ms": timed["stack"],
            "output_relative_diff": float((outputs["grouped"].float() - reference).abs().max() / reference.abs().max())}


def run_moe_bench(shape: MoeShape, *, device: str, dtype: str, steps: int, warmup: int,
                  log: Callable[[str], None] = lambda _: None) -> dict:
    """``time_experts`` in a process group of this process alone; the result dict ``format_markdown`` renders."""
    env = init_distributed(device)
    try:
        init_model_parallel(ParallelConfig(), seed=0, device=env.device)
        timed = time_experts(shape, device=env.device, dtype=DTYPES[dtype], steps=steps, warmup=warmup, log=log)
    finally:
        shutdown(env)
    return {"shape": asdict(shape), "device": device_name(env.device), "dtype": dtype, "steps": steps,
            "warmup_steps": warmup, "environment": {"platform": platform.platform(), **library_versions()}, **timed}


def format_markdown(result: dict, command: str) -> str:
    s, env = MoeShape(**result["shape"]), result["environment"]
    return "\n".join([
        "# Grouped-GEMM experts vs SequentialMLP", "",
        f"`{command}`", "",
        f"One MoE layer's experts: {s.experts} experts, top-{s.topk}, hidden {s.hidden}, expert FFN {s.ffn} (SwiGLU), "
        f"{s.tokens} tokens ({s.tokens * s.topk} expert rows, random routing), {result['dtype']} on {result['device']}; "
        f"forward + backward, median of {result['steps']} steps after {result['warmup_steps']}, the two taking turns.", "",
        "| experts | ms per step | speed |", "|---|---|---|",
        f"| sequential (megatron SequentialMLP) | {result['sequential_ms']:.2f} | 1.00x |",
        f"| grouped (GroupedExperts) | {result['grouped_ms']:.2f} | {result['speedup']:.2f}x |", "",
        f"Stacking the expert weights, the copy the grouped step makes per forward on CUDA (none on the CPU): "
        f"{result['stack_ms']:.2f} ms. "
        f"Outputs within {result['output_relative_diff']:.1e} of the largest.", "",
        f"torch {env.get('torch')}, megatron-core {env.get('megatron.core')}, {env.get('platform')}.", ""])
