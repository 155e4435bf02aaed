"""FP8 GEMMs through torchao's float8 training (``torchao.float8``, the ``fp8`` extra) for megatron-core's
column- and row-parallel linears: the FP8 that runs where Transformer Engine is absent.

Recipes (torchao's ``Float8LinearConfig.from_recipe_name``):
- ``tensorwise``: one scale per operand of each GEMM; E4M3 activations and weights, E5M2 gradients.
- ``rowwise``: one scale per row of each operand along the GEMM's contraction (a token's row of x or
  dy, an output row of W for the forward), E4M3 throughout, each scale rounded down to a power of two.
Both scale dynamically ("current" scaling): each operand's scale is the format's largest value over
the operand's absolute maximum (floored at 1e-12) taken at that GEMM. torchao 0.18 has no delayed
scaling, so no amax history is kept and nothing of FP8 goes into a checkpoint. Under TP each rank
scales its own weight shard (per tensor: the shard's amax; per row: each output row, whole in a
column shard, the rank's K-slice of it in a row-parallel shard).

The matmul is torchao's own autograd function (``matmul_with_hp_or_float8_args``, what its
``Float8Linear`` calls), compiled on CUDA (``torch.compile`` fuses the amax, scale and cast into a
few kernels around ``torch._scaled_mm``; torchtitan trains it so), eager elsewhere. The TP
communication is megatron's own mappings around it: under sequence parallelism the input is gathered
(its gradient reduce-scattered), otherwise its gradient is all-reduced over TP. Unlike megatron's
linear, the gathered input is what torchao saves for the weight gradient (TP times the local shard),
and the data gradient's collective does not overlap the weight-gradient GEMM.
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace
from typing import Optional

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

TORCHAO_RECIPES = ("tensorwise", "rowwise")
_ALIGN = 16  # torch._scaled_mm's dimension multiple on CUDA (the token dimension is the weight gradient's K)


def torchao_available() -> bool:
    """Whether the optional ``fp8`` extra (torchao) is installed; found, not imported."""
    return importlib.util.find_spec("torchao") is not None


@functools.lru_cache(maxsize=None)
def _torchao() -> SimpleNamespace:
    # lazy: importing torchao takes seconds and logs its kernels' loading; only a run or bench that
    # uses a torchao recipe pays it, not every command that imports the FP8 policy
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_utils import tensor_to_scale
    return SimpleNamespace(Float8LinearConfig=Float8LinearConfig, Float8Linear=Float8Linear,
                           matmul=matmul_with_hp_or_float8_args, get_maybe_axiswise_dim=get_maybe_axiswise_dim,
                           tensor_to_scale=tensor_to_scale)


@functools.lru_cache(maxsize=None)
def recipe_config(recipe: str):
    """torchao's ``Float8LinearConfig`` of a recipe name (``TORCHAO_RECIPES``)."""
    if recipe not in TORCHAO_RECIPES:
        raise ValueError(f"unknown torchao float8 recipe {recipe!r}; one of {TORCHAO_RECIPES}")
    return _torchao().Float8LinearConfig.from_recipe_name(recipe)


@functools.lru_cache(maxsize=None)
def _mm_config(recipe: str):
    # Float8Linear builds the per-GEMM settings (fast accumulation in the forward only) from the
    # config; a meta-device one is read for them rather than restating torchao's rule here.
    return _torchao().Float8Linear(_ALIGN, _ALIGN, bias=False, config=recipe_config(recipe),
                                   device="meta").linear_mm_config


def operand_scales(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x's scales, weight's scales) as torchao's forward GEMM of ``recipe`` computes them: x [M, K]
    -> [1, 1] per tensor or [M, 1] per token row; weight [N, K] (this rank's shard) -> [1, 1] or
    [N, 1] per output row. The same calls, arguments and axes as ``matmul_with_hp_or_float8_args``'s
    forward (weight passed transposed, scaled along its dim 0)."""
    config, ao = recipe_config(recipe), _torchao()
    scales = []
    for tensor, cast, dim in ((x, config.cast_config_input, -1), (weight.t(), config.cast_config_weight, 0)):
        scales.append(ao.tensor_to_scale(tensor, cast.target_dtype, scaling_granularity=cast.scaling_granularity,
                                         axiswise_dim=ao.get_maybe_axiswise_dim(dim, cast.scaling_granularity),
                                         round_scales_to_power_of_2=config.round_scales_to_power_of_2))
    x_scale, weight_t_scale = scales
    return x_scale.reshape(-1, 1), weight_t_scale.reshape(-1, 1)


@functools.lru_cache(maxsize=None)
def recipe_matmul(recipe: str, compiled: bool):
    """y [M, N] = f(x [M, K], W [N, K]) = x W^T in ``recipe``'s float8 (torchao's three GEMMs), M padded
    to the GEMM's multiple with zero rows (they change neither products nor any scale of a real row);
    ``compiled``: through ``torch.compile``, built once per recipe (the torchao objects are closed
    over, so the compiled graph holds the whole cast-and-GEMM with no break)."""
    matmul, mm_config, config = _torchao().matmul, _mm_config(recipe), recipe_config(recipe)

    def run(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = -(-rows // _ALIGN) * _ALIGN
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        return matmul.apply(x, weight.t(), mm_config, config)[:rows]

    return torch.compile(run) if compiled else run


def float8_matmul(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """``recipe_matmul``, compiled on CUDA as training runs it; no tokens is an empty product."""
    if x.shape[0] == 0:
        return x @ weight.t()
    return recipe_matmul(recipe, x.is_cuda)(x, weight)


def torchao_linear_forward(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: str,
                           *, allreduce_dgrad: bool, sequence_parallel: bool, tp_group) -> torch.Tensor:
    """megatron-core's ``linear_with_grad_accumulation_and_async_allreduce`` with torchao float8 GEMMs:
    input [s(/tp), b, K] -> [s, b, N]; under sequence parallelism the input is gathered over TP (its
    gradient reduce-scattered), with ``allreduce_dgrad`` its gradient is all-reduced over TP."""
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    tokens = input.reshape(-1, input.shape[-1])  # [s * b, K]
    output = float8_matmul(tokens, weight, recipe).reshape(*input.shape[:-1], weight.shape[0])  # [s, b, N]
    return output if bias is None else output + bias
