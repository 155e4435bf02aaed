"""The whole-linear rows of ``loongforge bench gemm``: the layer as training runs it, not only its GEMMs.

For each layer kind, megatron-core's own ``ColumnParallelLinear`` (qkv, fc1) or ``RowParallelLinear``
(proj, fc2) is built at the kind's TP size in a world of that many processes (one per rank, spawned
fresh), with sequence parallelism where the run has it (language layers; the vision tower and the
projector never split the sequence; routed experts communicate in the token dispatcher, not in the
layer). One optimizer step of ``micro_batches`` forwards and backwards is timed twice: the layer as
megatron runs it in bf16, and the same layer with ``models.layers.fp8.use_fp8`` (its weight quantised once
for the step through ``Fp8WeightCache``, the cache dropped at the step's end as training drops it).
So the FP8 figure pays everything FP8 costs in a run: the sequence gather and the reduce-scatter
or all-reduce around the GEMMs (the same bytes as bf16's), the activations' and gradients'
quantisation before every GEMM, and the weight's once per step. Figures are milliseconds per
micro-batch (a step's time over its micro-batches), rank 0's (the collectives of every micro-batch
keep the ranks together).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from loongforge.bench.model_step import time_steps
from loongforge.bench.processes import run_spawned
from loongforge.config.schema import ParallelConfig, RunConfig
from loongforge.models.layers.fp8 import Fp8WeightCache, use_fp8
from loongforge.parallel import mcore_patches
from loongforge.parallel.launch_env import order_tensor_parallel_kernels
from loongforge.parallel.distributed import init_distributed, init_model_parallel, shutdown
from loongforge.parallel.launch_env import free_port

# The most micro-batches one timed step holds by default: the weight's quantisation is shared by
# the step's micro-batches, so fewer than the run has overstates FP8's cost (never its gain).
DEFAULT_MAX_MICRO_BATCHES = 4


@dataclass(frozen=True)
class WholeLinear:
    """One layer kind as training builds it: ``shape`` is a ``bench.gemm.LinearShape`` (this rank's
    weight shard), ``column`` whether it is column-parallel, ``sequence_parallel`` whether its input
    (column) or output (row) is split along the sequence over TP, ``expert`` a routed expert's."""

    kind: str
    tp: int
    out_features: int  # this rank's shard [N, K]
    in_features: int
    column: bool
    sequence_parallel: bool
    expert: bool


def whole_linear(shape, cfg: RunConfig) -> WholeLinear:
    """The layer behind a ``LinearShape`` in ``cfg``'s run."""
    tower, _, name = shape.kind.partition(".")
    expert = name.startswith("expert_")
    column = name.removeprefix("expert_") in ("qkv", "fc1")
    sequence_parallel = (tower == "language" and not expert and shape.tp > 1 and cfg.parallel.sequence_parallel)
    return WholeLinear(shape.kind, shape.tp, shape.out_features, shape.in_features, column, sequence_parallel, expert)


def run_micro_batches(cfg: RunConfig, tp: int) -> int:
    """Micro-batches per rank per step in ``cfg``'s run at language TP ``tp`` (``parallel.world_size``
    ranks; one packed row per micro-batch)."""
    data_parallel = max(1, cfg.parallel.world_size // (tp * cfg.parallel.pipeline_model_parallel_size))
    return max(1, cfg.training.global_batch_size // data_parallel)


def rows_for(layer: WholeLinear, tokens: int) -> int:
    """``tokens`` rounded up so a sequence-parallel layer splits them evenly over its TP ranks."""
    return -(-tokens // layer.tp) * layer.tp if layer.sequence_parallel else tokens


def time_whole_linears(layers: Sequence[WholeLinear], counts: Sequence[int], *, device: torch.device,
                       micro_batches: int, steps: int, warmup: int,
                       log: Callable[[str], None] = lambda message: None,
                       recipes: Sequence[str] = ()) -> dict[str, list[dict]]:
    """kind -> one timing per token count: the whole layer per micro-batch in bf16, FP8 (scaled_mm)
    and each of torchao's ``recipes``. Layers
    of each TP size run in a world of that many processes; on CUDA a TP size above the visible GPUs
    is left out with a line (the kind's policy then rests on its GEMM rows)."""
    timings: dict[str, list[dict]] = {}
    for tp in sorted({layer.tp for layer in layers}):
        group = [layer for layer in layers if layer.tp == tp]
        if device.type == "cuda" and torch.cuda.device_count() < tp:
            log(f"whole linear at TP {tp} needs {tp} GPUs and this machine has {torch.cuda.device_count()}: "
                f"{', '.join(layer.kind for layer in group)} keep their GEMM rows only (--tp 1 measures them here)")
            continue
        port = free_port()
        results = run_spawned(_linear_rank, [(rank, tp, port, device.type, group, list(counts), micro_batches,
                                              steps, warmup, tuple(recipes)) for rank in range(tp)], what="bench gemm (whole linear)",
                              on_cuda=device.type == "cuda")
        timings.update(next(result for result in results if result is not None))
    return timings


def _linear_rank(results_queue, rank: int, tp: int, port: int, device_type: str, layers: list[WholeLinear],
                 counts: list[int], micro_batches: int, steps: int, warmup: int, recipes: tuple = ()) -> None:
    """One TP rank: every layer of ``layers`` at every token count; rank 0 puts the timings, the
    others None."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    order_tensor_parallel_kernels(tp > 1)  # as a training run with this TP: megatron's overlap, its console
    env = init_distributed(device_type)
    try:
        if env.device.type == "cpu":
            mcore_patches.apply_cpu()  # megatron's sequence-parallel gather buffer assumes CUDA
        init_model_parallel(ParallelConfig(tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp,
                                           world_size=tp), seed=0, device=env.device)
        timings = {}
        with tqdm(total=len(layers) * len(counts), desc=f"bench gemm, whole linear (TP {tp})", unit="shape",
                  disable=None if rank == 0 else True) as bar:
            for layer in layers:
                timings[layer.kind] = []
                for tokens in counts:
                    timings[layer.kind].append(time_layer(layer, tokens, device=env.device, micro_batches=micro_batches,
                                                          steps=steps, warmup=warmup, recipes=recipes))
                    bar.update(1)
        results_queue.put(timings if rank == 0 else None)
    finally:
        shutdown(env)


def build_layer(layer: WholeLinear, device: torch.device) -> torch.nn.Module:
    """megatron-core's linear for ``layer`` at this world's TP size, bf16, weights from the seed."""
    # lazy: megatron-core's layers are needed in the measuring ranks only, not in the command's process
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=layer.tp, expert_tensor_parallel_size=layer.tp,
                                 sequence_parallel=layer.sequence_parallel, params_dtype=torch.bfloat16,
                                 use_cpu_initialization=device.type == "cpu")
    torch.manual_seed(0)
    init = torch.nn.init.xavier_normal_
    if layer.column:
        return ColumnParallelLinear(layer.in_features, layer.out_features * layer.tp, config=config, init_method=init,
                                    bias=False, gather_output=False, skip_bias_add=True, is_expert=layer.expert)
    return RowParallelLinear(layer.in_features * layer.tp, layer.out_features, config=config, init_method=init,
                             bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=layer.expert)


def layer_tensors(layer: WholeLinear, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output gradient) of one micro-batch of ``tokens`` rows, [s, 1, width] as megatron's
    layers take them: column-parallel input [s/tp, 1, K] under SP else [s, 1, K], output [s, 1, N/tp];
    row-parallel input [s, 1, K/tp], output [s/tp, 1, N] under SP else [s, 1, N]."""
    rows = rows_for(layer, tokens)
    local = rows // layer.tp if layer.sequence_parallel else rows
    in_rows, out_rows = (local, rows) if layer.column else (rows, local)
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(in_rows, 1, layer.in_features, device=device, dtype=torch.bfloat16, generator=generator)
    grad_out = torch.randn(out_rows, 1, layer.out_features, device=device, dtype=torch.bfloat16, generator=generator)
    return x.requires_grad_(True), grad_out


def time_layer(layer: WholeLinear, tokens: int, *, device: torch.device, micro_batches: int, steps: int,
               warmup: int, recipes: Sequence[str] = ()) -> dict:
    """One token count: milliseconds per micro-batch of the bf16 layer and of its FP8 twin (same
    weights), FP8's relative error on the output, the FP8 weight quantisations per step, and each of
    torchao's ``recipes``' twin (``<recipe>_ms``, ``<recipe>_error``)."""
    x, grad_out = layer_tensors(layer, tokens, device)
    bf16, fp8 = build_layer(layer, device), build_layer(layer, device)
    cache = Fp8WeightCache()
    if not use_fp8(fp8, cache):
        raise ValueError(f"{layer.kind}: weight shard {layer.out_features}x{layer.in_features} is not FP8-eligible")

    def step(module: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            for _ in range(micro_batches):
                output, _ = module(x)
                output.backward(grad_out)
            module.weight.grad = None  # the optimizer step: new weights, so a new FP8 copy next step
            cache.weights_changed()
        return run

    bf16_s, fp8_s = (statistics.mean(time_steps(step(module), device, steps=steps, warmup_steps=warmup))
                     for module in (bf16, fp8))
    timed_steps = steps + warmup
    with torch.no_grad():
        reference, quantised = bf16(x)[0].float(), fp8(x)[0].float()
    cache.weights_changed()
    bf16_ms, fp8_ms = (1e3 * seconds / micro_batches for seconds in (bf16_s, fp8_s))
    timing = {"tokens": rows_for(layer, tokens), "bf16_ms": bf16_ms, "fp8_ms": fp8_ms, "speedup": bf16_ms / fp8_ms,
              "relative_error": _relative(quantised, reference),
              "weight_quantisations_per_step": (cache.quantisations - 1) / timed_steps,
              "micro_batches": micro_batches}
    for recipe in recipes:
        twin = build_layer(layer, device)
        use_fp8(twin, recipe=recipe)
        seconds = statistics.mean(time_steps(step(twin), device, steps=steps, warmup_steps=warmup))
        with torch.no_grad():
            timing[f"{recipe}_error"] = _relative(twin(x)[0].float(), reference)
        timing[f"{recipe}_ms"] = 1e3 * seconds / micro_batches
    return timing


def _relative(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return float((actual - reference).norm() / reference.norm().clamp(min=1e-30))


def micro_batches_to_time(cfg: RunConfig, requested: Optional[int]) -> int:
    """``--micro-batches`` or the run's micro-batches per step, at most ``DEFAULT_MAX_MICRO_BATCHES``."""
    if requested is not None:
        return requested
    return min(DEFAULT_MAX_MICRO_BATCHES, run_micro_batches(cfg, cfg.parallel.tensor_model_parallel_size))
