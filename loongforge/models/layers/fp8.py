"""FP8 linear layers through ``torch._scaled_mm``: the torch-native FP8 path (no Transformer Engine).

Recipe (per-tensor current scaling, "hybrid" formats as Transformer Engine calls them): every GEMM
of a linear layer (forward ``y = x W^T``, data gradient ``dx = dy W``, weight gradient
``dW = dy^T x``) reads FP8 operands, each quantised with its own scale (the tensor's absolute
maximum, floored at ``AMAX_FLOOR``, mapped to the format's largest value); activations and weights
in E4M3 (more mantissa), gradients in E5M2 (more range); the products accumulate in fp32 inside the
GEMM and come out in the input's dtype. Activations and gradients are quantised right before their
GEMM; a weight once per optimizer step (``Fp8WeightCache``: its E4M3 copy serves the forward of
every micro-batch, recomputed forwards and the data-gradient GEMMs, whose per-tensor quantisation of
``W^T`` is the transpose of ``W``'s). No amax history is kept (current scaling), so nothing of FP8
goes into a checkpoint: the weights stay in their training dtype and FP8 copies live for one step.
Shapes: ``_scaled_mm`` on CUDA needs every dimension a multiple of 16; the token dimension is
padded with zero rows (zeros change neither the products nor the amax), and a layer whose own widths
are not multiples of 16 is not eligible (``eligible``).

``fp8_linear_forward`` is the drop-in for megatron-core's ``_forward_impl`` of its column- and
row-parallel linears: the same tensor-parallel communication on the same schedule and memory
(``Fp8TensorParallelLinear``: under sequence parallelism the local input shard is saved and gathered
again in the backward; the data gradient's reduce-scatter or all-reduce overlaps the weight-gradient
GEMM), the FP8 GEMMs in between. ``use_fp8`` installs it on chosen layers of a built model.

That is the ``scaled_mm`` recipe. The others are torchao's float8 training (``tensorwise``,
``rowwise``: ``models.layers.fp8_torchao``), chosen per layer kind by the measured policy
(``fp8.policy``) or for every layer by ``fp8.recipe``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.parallel_state import get_tensor_model_parallel_group

from loongforge.config.errors import InputError
from loongforge.config.layout import (
    expert_tensor_parallel_size,
    vision_tensor_parallel_size,
)
from loongforge.config.schema import RunConfig
from loongforge.models.layers.fp8_torchao import TORCHAO_RECIPES, torchao_available, torchao_linear_forward
from loongforge.models.layers.layer_kinds import layer_kind
from loongforge.parallel.distributed import all_gather_tensor, reduce_scatter_tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_ALIGN = 16  # _scaled_mm's dimension multiple on CUDA
SCALED_MM = "scaled_mm"  # this module's FP8 GEMMs; torchao's recipes are the others
RECIPES = (*TORCHAO_RECIPES, SCALED_MM)


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


# The smallest absolute maximum a scale is computed from (torchao's floor). Without one, a tensor
# whose amax is tiny but not 0 (1e-35) gets scale E5M2 max / amax = inf in fp32, and its zeros
# 0 * inf = NaN. With it such a tensor's values quantise to (nearly) 0, as they are next to any
# value the GEMM's other operand can bring, and an all-zero tensor needs no case of its own.
AMAX_FLOOR = 1e-12


def quantize(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 tensor, inverse scale): ``tensor ~= fp8.float() * inverse_scale``, the absolute maximum
    (at least ``AMAX_FLOOR``) mapped to the format's largest finite value."""
    amax = tensor.detach().abs().max().float().clamp(min=AMAX_FLOOR)
    scale = _fp8_max(dtype) / amax
    fp8 = (tensor.float() * scale).clamp(-_fp8_max(dtype), _fp8_max(dtype)).to(dtype)
    return fp8, scale.reciprocal()


class Fp8WeightCache:
    """The E4M3 copies of FP8 layers' weights for one optimizer step: a weight is quantised at its
    first GEMM of the step and the copy serves every later one (the forward of each micro-batch, a
    recomputed forward, the data gradient's ``W^T``). ``weights_changed`` (the training step calls it
    after ``optimizer.step``) drops them. ``quantisations`` counts the weights quantised."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.quantisations = 0

    def get(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(E4M3 weight [N, K], inverse scale) of ``weight`` as it is in this step."""
        entry = self._copies.get(id(weight))
        if entry is None or entry[0] is not weight:
            entry = (weight, *quantize(weight.detach(), E4M3))
            self._copies[id(weight)] = entry
            self.quantisations += 1
        return entry[1], entry[2]

    def weights_changed(self) -> None:
        self._copies.clear()


def _quantized_weight(weight: torch.Tensor, cache: Optional[Fp8WeightCache]) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize(weight, E4M3) if cache is None else cache.get(weight)


def _pad_rows(tensor: torch.Tensor) -> torch.Tensor:
    rows = tensor.shape[0]
    padded = -(-rows // _ALIGN) * _ALIGN
    return tensor if padded == rows else torch.nn.functional.pad(tensor, (0, 0, 0, padded - rows))


def scaled_matmul(a: torch.Tensor, a_dtype: torch.dtype, b_t: torch.Tensor, b_dtype: torch.dtype,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b_t.T`` with both operands quantised: a [M, K], b_t [N, K] (row-major, as a weight is
    stored) -> [M, N] in ``out_dtype``. Rows of ``a`` are padded to the GEMM's multiple."""
    return matmul_quantized_b(a, a_dtype, *quantize(b_t, b_dtype), out_dtype)


def matmul_quantized_b(a: torch.Tensor, a_dtype: torch.dtype, b_t_fp8: torch.Tensor, b_inverse: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """``scaled_matmul`` with the second operand already quantised (``b_t_fp8`` [N, K] row-major)."""
    rows = a.shape[0]
    a_fp8, a_inverse = quantize(_pad_rows(a), a_dtype)
    # _scaled_mm takes its second operand column-major: the transpose of a row-major [N, K].
    out = torch._scaled_mm(a_fp8, b_t_fp8.t(), scale_a=a_inverse, scale_b=b_inverse, out_dtype=out_dtype)
    return out[:rows]


def forward_gemm(x: torch.Tensor, weight: torch.Tensor, cache: Optional[Fp8WeightCache]) -> torch.Tensor:
    """y [M, N] = x [M, K] W^T, W [N, K]; no tokens is an empty product (nothing to quantise)."""
    if x.shape[0] == 0:
        return x @ weight.t()
    return matmul_quantized_b(x, E4M3, *_quantized_weight(weight, cache), x.dtype)


def input_gradient_gemm(grad_out: torch.Tensor, weight: torch.Tensor, cache: Optional[Fp8WeightCache],
                        dtype: torch.dtype) -> torch.Tensor:
    """dx [M, K] = dy [M, N] @ W [N, K]: the second operand row-major is W^T [K, N], whose per-tensor
    quantisation is the transpose of W's (the same amax, elementwise)."""
    if grad_out.shape[0] == 0:
        return grad_out @ weight
    weight_fp8, weight_inverse = _quantized_weight(weight, cache)
    return matmul_quantized_b(grad_out, E5M2, weight_fp8.t().contiguous(), weight_inverse, dtype)


def weight_gradient_gemm(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dW [N, K] = dy^T [N, M] @ x [M, K]: the token dimension is the contraction here; padded on both
    sides (zero tokens add nothing)."""
    if x.shape[0] == 0:
        return torch.zeros_like(weight)
    dy_t = _pad_rows(grad_out).t().contiguous()  # [N, M']
    x_t = _pad_rows(x).t().contiguous()  # [K, M']
    return scaled_matmul(dy_t, E5M2, x_t, E4M3, weight.dtype)


class Fp8Matmul(torch.autograd.Function):
    """y = x W^T with all three GEMMs in FP8. x [M, K] (M tokens), weight [N, K]; ``cache``: where
    the weight's E4M3 copy for the step is kept (None: quantised at each GEMM)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, cache: Optional[Fp8WeightCache] = None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.cache = cache
        return forward_gemm(x, weight, cache)  # [M, N]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()  # [M, N]
        return (input_gradient_gemm(grad_out, weight, ctx.cache, x.dtype),
                weight_gradient_gemm(grad_out, x, weight), None)


class Fp8TensorParallelLinear(torch.autograd.Function):
    """A tensor-parallel linear's communication around the three FP8 GEMMs, scheduled as
    megatron-core's own linear schedules it.

    ``sequence_parallel``: the input x [s/tp, b, K] is all-gathered over TP for the forward GEMM, and
    only the local shard is saved: the backward gathers it again (while the data-gradient GEMM runs)
    for the weight gradient, so the layer holds 1/tp of the gathered input between forward and
    backward, as megatron's does. The data gradient [s, b, K] is reduce-scattered back while the
    weight-gradient GEMM runs. Otherwise (``allreduce_dgrad``) x [s, b, K] is whole and its gradient
    is all-reduced over TP, also while the weight-gradient GEMM runs.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, cache: Optional[Fp8WeightCache],
                sequence_parallel: bool, group) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.cache, ctx.sequence_parallel, ctx.group = cache, sequence_parallel, group
        total = _gather_sequence(x, group)[0] if sequence_parallel else x  # [s, b, K]
        output = forward_gemm(total.reshape(-1, total.shape[-1]), weight, cache)  # [s * b, N]
        return output.view(*total.shape[:-1], weight.shape[0])  # [s, b, N]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        group = ctx.group
        if ctx.sequence_parallel:
            total, gathering = _gather_sequence(x, group, async_op=True)  # overlaps the dgrad GEMM
        grad_out = grad_out.contiguous()
        dy = grad_out.view(-1, grad_out.shape[-1])  # [s * b, N]
        grad_total = input_gradient_gemm(dy, weight, ctx.cache, x.dtype)  # [s * b, K]
        if ctx.sequence_parallel:
            gathering.wait()
            grad_x = torch.empty_like(x)  # [s/tp, b, K]
            reducing = reduce_scatter_tensor()(grad_x, grad_total.view(-1, *x.shape[1:]), group=group, async_op=True)
        else:
            total, grad_x = x, grad_total.view(x.shape)
            reducing = dist.all_reduce(grad_x, group=group, async_op=True)
        grad_w = weight_gradient_gemm(dy, total.reshape(-1, total.shape[-1]), weight)  # overlaps the reduction
        reducing.wait()
        return grad_x, grad_w, None, None, None


def _gather_sequence(x: torch.Tensor, group, async_op: bool = False):
    """(x [s/tp, b, K] of every TP rank concatenated along the sequence: [s, b, K], the collective's
    handle when ``async_op``)."""
    total = x.new_empty(x.shape[0] * group.size(), *x.shape[1:])
    handle = all_gather_tensor()(total, x.contiguous(), group=group, async_op=async_op)
    return total, handle


def eligible(weight: torch.Tensor) -> bool:
    """Whether a linear's weight [N, K] (this rank's shard) fits FP8 GEMMs."""
    return weight.dim() == 2 and weight.shape[0] % _ALIGN == 0 and weight.shape[1] % _ALIGN == 0


def fp8_linear_forward(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       allreduce_dgrad: bool = False, sequence_parallel: bool = False,
                       tp_group=None, cache: Optional[Fp8WeightCache] = None) -> torch.Tensor:
    """megatron-core's ``linear_with_grad_accumulation_and_async_allreduce`` with FP8 GEMMs (the
    weight's E4M3 copy kept in ``cache`` for the step, when given).

    input [s(/tp), b, K] -> [s, b, N]. Under sequence parallelism the input is all-gathered over TP
    (its gradient reduce-scattered back); with ``allreduce_dgrad`` the input gradient is all-reduced
    over TP (``Fp8TensorParallelLinear``: megatron's schedule and memory).
    """
    if sequence_parallel or allreduce_dgrad:
        group = tp_group if tp_group is not None else get_tensor_model_parallel_group()
        output = Fp8TensorParallelLinear.apply(input, weight, cache, sequence_parallel, group)  # [s, b, N]
    else:
        tokens = input.reshape(-1, input.shape[-1])  # [s * b, K]
        output = Fp8Matmul.apply(tokens, weight, cache).reshape(*input.shape[:-1], weight.shape[0])  # [s, b, N]
    return output if bias is None else output + bias


_IMPL_ARGUMENTS = ("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad",
                   "sequence_parallel", "grad_output_buffer", "wgrad_deferral_limit", "tp_group")


def _fp8_impl(original: Callable, cache: Optional[Fp8WeightCache], min_rows: int, recipe: str,
              *args, **kwargs) -> torch.Tensor:
    """A linear's ``_forward_impl`` with ``recipe``'s FP8 GEMMs from ``min_rows`` rows of a GEMM call on (the
    rows this call really has: a micro-batch's packed tokens after the sequence-parallel gather, the
    tokens routed to one expert); a frozen weight (no weight gradient, nothing to gain), a deferred
    weight gradient and a call with fewer rows run the original."""
    bound = {**dict(zip(_IMPL_ARGUMENTS, args)), **kwargs}
    if not bound["weight"].requires_grad or bound.get("grad_output_buffer") is not None:
        return original(*args, **kwargs)
    sequence_parallel, tp_group = bound.get("sequence_parallel", False), bound.get("tp_group")
    if min_rows and _gemm_rows(bound["input"], sequence_parallel, tp_group) < min_rows:
        return original(*args, **kwargs)  # bf16 measured faster at this size
    if recipe != SCALED_MM:
        group = tp_group if tp_group is not None else get_tensor_model_parallel_group()
        return torchao_linear_forward(bound["input"], bound["weight"], bound.get("bias"), recipe,
                                      allreduce_dgrad=bound.get("allreduce_dgrad", False),
                                      sequence_parallel=sequence_parallel, tp_group=group)
    return fp8_linear_forward(bound["input"], bound["weight"], bound.get("bias"),
                              allreduce_dgrad=bound.get("allreduce_dgrad", False),
                              sequence_parallel=sequence_parallel, tp_group=tp_group, cache=cache)


def _gemm_rows(input: torch.Tensor, sequence_parallel: bool, tp_group) -> int:
    """The rows of this call's GEMMs: the input's tokens, gathered over TP under sequence parallelism."""
    rows = input.numel() // input.shape[-1]
    if sequence_parallel:
        rows *= (tp_group if tp_group is not None else get_tensor_model_parallel_group()).size()
    return rows


def use_fp8(module: torch.nn.Module, cache: Optional[Fp8WeightCache] = None, min_rows: int = 0,
            recipe: str = SCALED_MM) -> bool:
    """Run this megatron column/row-parallel linear's GEMMs in FP8 (``recipe``) from now on, in every
    call with at least ``min_rows`` rows (0: every call), its weight's E4M3 copy kept in ``cache`` for
    the step (None: quantised at each GEMM; torchao's recipes cast the weight at each GEMM, fused by
    the compile); False (and nothing changed) when its weight shard is not ``eligible``."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; one of {RECIPES}")
    if not eligible(module.weight):
        return False
    module._forward_impl = functools.partial(_fp8_impl, module._forward_impl, cache, min_rows, recipe)
    module.fp8 = recipe
    return True


# ---------------------------------------------------------------------------------------------
# Which layers: layer kinds, the measured policy, the device
# ---------------------------------------------------------------------------------------------

# Kinds are ``models.layers.layer_kinds``' (the LM head, ``output_layer``, has none: never FP8).
POLICY_FORMAT = "loongforge-fp8-policy"


@dataclass(frozen=True)
class Fp8Policy:
    """What ``loongforge bench gemm`` measured: per layer kind and TP size, the FP8 recipe chosen and
    the smallest token count at which it was at least ``min_speedup`` times faster than bf16 (None:
    no recipe was, at any measured count)."""

    min_tokens: dict  # kind -> {tp size (int) -> smallest token count or None}
    min_speedup: float
    device: str
    source: str = "policy"
    recipes: dict = field(default_factory=dict)  # kind -> {tp size -> recipe}; absent: SCALED_MM

    def recipe(self, kind: str, tp: int) -> str:
        return self.recipes.get(kind, {}).get(tp, SCALED_MM)

    def min_rows(self, kind: str, tp: int) -> Optional[int]:
        """The fewest rows of a GEMM call at which a layer of ``kind`` at TP ``tp`` runs FP8; None:
        never (FP8 never won, or not measured at this TP)."""
        return self.min_tokens.get(kind, {}).get(tp)

    def uses_fp8(self, kind: str, tp: int, tokens: int) -> bool:
        threshold = self.min_rows(kind, tp)
        return threshold is not None and tokens >= threshold

    @classmethod
    def load(cls, path: str | Path) -> "Fp8Policy":
        """Read a policy file; a file that is not one is an InputError naming it and the key."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InputError(f"{path}: cannot read the FP8 policy ({exc}); make one with loongforge bench gemm") from exc
        if not isinstance(data, dict) or data.get("format") != POLICY_FORMAT:
            raise InputError(f"{path}: not an FP8 policy (\"format\" is not {POLICY_FORMAT!r}); make one with "
                             f"loongforge bench gemm")
        try:
            min_tokens = {kind: {int(tp): (None if entry["min_tokens"] is None else int(entry["min_tokens"]))
                                 for tp, entry in by_tp.items()}
                          for kind, by_tp in data["layers"].items()}
            # Policies written before the recipes were measured chose the scaled_mm GEMMs (null: bf16).
            recipes = {kind: {int(tp): str(entry.get("recipe") or SCALED_MM) for tp, entry in by_tp.items()}
                       for kind, by_tp in data["layers"].items()}
            unknown = sorted({r for by_tp in recipes.values() for r in by_tp.values()} - set(RECIPES))
            if unknown:
                raise ValueError(f"recipe {unknown[0]!r} is not one of {RECIPES}")
            return cls(min_tokens=min_tokens, min_speedup=float(data["min_speedup"]), device=str(data["device"]),
                       source=str(path), recipes=recipes)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{path}: FP8 policy entry missing or malformed ({exc!r}); regenerate it with "
                             f"loongforge bench gemm") from exc


def fp8_gemms_available(device: torch.device) -> bool:
    """FP8 tensor-core GEMMs: CUDA compute capability 8.9 (Ada) or newer (Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def apply_fp8(model: torch.nn.Module, choice_of: Callable[[str], Optional[tuple[int, str]]],
              cache: Optional[Fp8WeightCache] = None) -> dict[str, tuple[int, int]]:
    """Switch the linears of every kind ``choice_of`` gives (a row count, a recipe) (None: bf16) to
    that recipe's FP8 GEMMs from that many rows of a call on (0: always), their weights' E4M3 copies
    kept in ``cache``; returns, per kind found, (layers now FP8, layers of that kind) (a shard with widths off the
    GEMM's multiple stays)."""
    counts: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        kind = layer_kind(name)
        if kind is None or not hasattr(module, "_forward_impl") or not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        count = counts.setdefault(kind, [0, 0])
        count[1] += 1
        choice = choice_of(kind)
        # A frozen weight's GEMMs stay bf16 (``_fp8_impl``: no weight gradient, nothing to gain).
        if choice is not None and module.weight.requires_grad and use_fp8(module, cache, *choice):
            count[0] += 1
    return {kind: (on, total) for kind, (on, total) in sorted(counts.items())}


def gemm_tokens(cfg: RunConfig, kind: str) -> int:
    """An estimate of the rows of a layer kind's GEMMs in one micro-batch of ``cfg``'s run, where
    ``bench gemm`` times and marks a kind: a packed row's tokens in the language model (the gathered
    sequence under sequence parallelism), their even share per expert (``seq_len * topk / experts``)
    in routed experts; the patches of the largest image (``data.max_pixels``) in the vision tower,
    merged units in the projector. A run compares each GEMM call's real rows with the policy."""
    tower, _, name = kind.partition(".")
    if tower == "language":
        lang = cfg.model.language
        if name.startswith("expert_"):
            return max(1, cfg.data.seq_len * lang.moe.router_topk // lang.moe.num_experts)
        return cfg.data.seq_len
    vision = cfg.model.vision
    patches = max(1, cfg.data.max_pixels // vision.patch_size ** 2)
    return patches if tower == "vision" else max(1, patches // cfg.model.projector.spatial_merge_size ** 2)


def gemm_tp(cfg: RunConfig, kind: str) -> int:
    """The TP size that shards a layer kind's weights in ``cfg``'s run."""
    tower, _, name = kind.partition(".")
    if tower == "language":
        return expert_tensor_parallel_size(cfg.parallel) if name.startswith("expert_") else \
            cfg.parallel.tensor_model_parallel_size
    return vision_tensor_parallel_size(cfg.parallel)


def device_name(device: torch.device) -> str:
    """The name a policy records and is checked against (``torch.cuda.get_device_name``; "cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def fp8_choice(cfg: RunConfig, device: torch.device,
               layer_backend: str) -> tuple[Optional[Callable[[str], Optional[tuple[int, str]]]], str]:
    """(per layer kind, the fewest rows of a GEMM call at which its layers run FP8 (0 for always)
    and the recipe, or None for never; or None for no FP8 at all; the line saying so) for ``training.fp8`` on ``device``,
    whose linears the resolved ``layer_backend`` builds. A policy's thresholds are compared with
    each call's real rows (``_fp8_impl``), not with an estimate of the run's shapes."""
    mode = cfg.training.fp8
    if mode == "off":
        return None, "fp8: off"
    check_fp8_backend(mode, layer_backend)
    if layer_backend == "te":  # auto: Transformer Engine's linears have an FP8 of their own, not driven here
        return None, ("fp8: auto, but the layers are Transformer Engine's (model.layer_backend=te), whose FP8 "
                      "loongforge does not drive: bf16 everywhere (model.layer_backend=flash for FP8)")
    if not fp8_gemms_available(device):
        if mode == "on":
            raise InputError(f"training.fp8=on needs a CUDA GPU with FP8 GEMMs (compute capability 8.9+); this "
                             f"run's device is {device}: set training.fp8=off (or auto, which falls back to bf16).")
        return None, f"fp8: auto, but {device} has no FP8 GEMMs (CUDA compute capability 8.9+): bf16 everywhere"
    if mode == "on":
        recipe = on_recipe(cfg.fp8.recipe)
        return (lambda kind: (0, recipe)), f"fp8: on, {recipe} (every eligible linear but the LM head)"
    if cfg.fp8.policy is None:
        return None, "fp8: auto without fp8.policy: bf16 everywhere (measure a policy with loongforge bench gemm)"
    policy = Fp8Policy.load(cfg.fp8.policy)
    here = device_name(device)
    if policy.device != here:  # where FP8 pays is a property of the device's GEMMs
        raise InputError(f"fp8.policy={cfg.fp8.policy} was measured on {policy.device} and this run's device is "
                         f"{here}: measure a policy here with loongforge bench gemm (or set training.fp8=off).")
    missing = sorted({recipe for by_tp in policy.recipes.values() for recipe in by_tp.values()} & set(TORCHAO_RECIPES))
    if missing and not torchao_available():
        raise InputError(f"fp8.policy={cfg.fp8.policy} chose torchao's {missing[0]} float8 and torchao does not import "
                         f"here: pip install 'loongforge[fp8]' (or set training.fp8=off).")

    def choice(kind: str) -> Optional[tuple[int, str]]:
        tp = gemm_tp(cfg, kind)
        min_rows = policy.min_rows(kind, tp)
        return None if min_rows is None else (min_rows, policy.recipe(kind, tp))

    return choice, (f"fp8: auto, per layer kind and recipe from {policy.source} (measured on {policy.device}), "
                    f"each GEMM call by its own rows")


def on_recipe(setting: str) -> str:
    """The recipe of ``training.fp8=on`` for ``fp8.recipe``: ``auto`` is torchao's tensorwise where
    torchao imports (the recipe torchtitan trains with), else this module's scaled_mm GEMMs."""
    if setting == "auto":
        return TORCHAO_RECIPES[0] if torchao_available() else SCALED_MM
    if setting in TORCHAO_RECIPES and not torchao_available():
        raise InputError(f"fp8.recipe={setting} is torchao's float8 and torchao does not import here: pip install "
                         f"'loongforge[fp8]' or set fp8.recipe=scaled_mm (or auto).")
    return setting


def check_fp8_backend(mode: str, layer_backend: str) -> None:
    """FP8 here runs on megatron's local linears (``use_fp8``); Transformer Engine's linears have
    their own FP8, which loongforge does not drive: ``on`` is refused rather than silently left in
    bf16 (``auto`` trains bf16 and says so: ``fp8_choice``)."""
    if mode == "on" and layer_backend == "te":
        raise InputError(f"training.fp8={mode} runs on the local linears (model.layer_backend=flash or sdpa) and "
                         f"this run resolves model.layer_backend to te; set model.layer_backend=flash.")


def describe_fp8_layers(counts: dict[str, tuple[int, int]]) -> str:
    """``language.fc1 8/8, vision.qkv 0/4``: FP8 layers / layers of each kind."""
    return ", ".join(f"{kind} {on}/{total}" for kind, (on, total) in counts.items())
