"""Derived parallel sizes: pure arithmetic over a ParallelConfig and the launch's world size.

Validation (``loongforge.config.validate``) checks the layout is consistent; these helpers assume
it is and are shared by the dry-run plan and the trainer so every place derives DP the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.config.schema import ParallelConfig


@dataclass(frozen=True)
class ParallelSizes:
    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    vision_tensor_parallel: int
    data_parallel: int


def vision_tensor_parallel_size(parallel: ParallelConfig) -> int:
    """Vision TP defaults to the language TP (null in the config)."""
    if parallel.vision_tensor_model_parallel_size is None:
        return parallel.tensor_model_parallel_size
    return parallel.vision_tensor_model_parallel_size


def derive_parallel_sizes(parallel: ParallelConfig, world_size: int | None = None) -> ParallelSizes:
    """TP, PP and vision TP from the config; DP = world / (TP x PP), world from the launch."""
    world = parallel.world_size if world_size is None else world_size
    model_parallel = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
    return ParallelSizes(
        world_size=world,
        tensor_parallel=parallel.tensor_model_parallel_size,
        pipeline_parallel=parallel.pipeline_model_parallel_size,
        vision_tensor_parallel=vision_tensor_parallel_size(parallel),
        data_parallel=world // model_parallel,
    )


def layers_per_stage(num_layers: int, pipeline_parallel: int) -> list[int]:
    """Language layers held by each pipeline stage (even split; validation requires PP | layers)."""
    return [num_layers // pipeline_parallel] * pipeline_parallel


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]
