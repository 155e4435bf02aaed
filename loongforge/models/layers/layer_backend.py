"""Which implementation a transformer block is built from: the one seam between backends.

``model.layer_backend`` selects it:

- ``te``: megatron-core's Transformer Engine modules, as its own TE spec uses them: each pre-norm
  fused into the linear after it (``TELayerNormColumnParallelLinear``), TE column/row linears, TE
  attention. CUDA and ``transformer_engine`` only.
- ``flash``: megatron-core's local (plain torch) linears with flash-attn's varlen kernel per packed
  segment. CUDA, ``flash_attn`` and fp16/bf16 only (its kernels take no fp32).
- ``varlen``: local linears with torch's own varlen kernel (``torch.nn.attention.varlen``, torch >= 2.10),
  one call per packed row. CUDA and fp16/bf16 only: the fast path where flash-attn does not install.
- ``sdpa``: local linears with torch SDPA per packed segment. Runs anywhere; the CPU path and the
  numerical reference.
- ``auto``: ``te`` where it can run, else ``flash``, else ``varlen``, else ``sdpa``. Never a kernel that
  cannot run the device and dtype.

``model.language.moe.experts`` selects the routed experts' module the same way (``resolve_experts``):

- ``grouped``: ``GroupedExperts``, one grouped GEMM per projection (``torch._grouped_mm`` on CUDA, bf16 only;
  elsewhere a loop over the experts with the same math);
- ``sequential``: megatron-core's ``SequentialMLP`` (seeded per expert), one MLP call per expert;
- ``auto``: ``grouped`` on CUDA at bf16, where its kernel runs; else ``sequential``: on the CPU megatron's own
  module stays the reference every other proof runs against (the grouped loop measured 1.3x faster there too,
  ``loongforge bench moe``, docs/benchmarks/moe.md; pick it with ``grouped``).

Both hold the same parameters under the same names, so a checkpoint written with one loads with the other.

Every backend names its weights the same way (``state_dict_names``): the local blocks fuse their
pre-norms into the following linear too (``RMSNormColumnParallelLinear``), so a checkpoint written
with one backend loads with another.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.errors import ConfigError
from loongforge.config.language_parts import EXPERT_KINDS
from loongforge.models.decoder import linear_attention
from loongforge.models.layers.attention import FlashCoreAttention, SDPACoreAttention, VarlenCoreAttention
from loongforge.models.layers.grouped_experts import GroupedExperts
from loongforge.models.layers.initialization import SeededSequentialMLP

LAYER_BACKENDS = ("auto", "te", "flash", "varlen", "sdpa")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn's kernels and torch's varlen (flash inside)
_PACKAGES = {"te": "transformer_engine", "flash": "flash_attn", "varlen": "torch.nn.attention.varlen"}
# How to get each package where it is missing.
_REMEDIES = {"te": "pip install 'loongforge[gpu]'", "flash": "pip install 'loongforge[gpu]'",
             "varlen": "torch >= 2.10"}
_AUTO_ORDER = ("te", "flash", "varlen", "sdpa")  # what auto takes: the first that can run
_ATTENTION = {"flash": FlashCoreAttention, "varlen": VarlenCoreAttention, "sdpa": SDPACoreAttention}
_EXPERT_MODULES = {"grouped": GroupedExperts, "sequential": SeededSequentialMLP}
_EXPERTS_KEY = "model.language.moe.experts"


class RMSNorm(torch.nn.Module):
    """RMSNorm as Qwen computes it: normalise in fp32, cast back, then scale.

    Built with megatron's norm signature ``(config, hidden_size, eps)``. Under sequence parallelism
    each TP rank sees different tokens, so the weight is marked ``sequence_parallel`` and megatron's
    ``finalize_model_grads`` all-reduces its gradient over TP.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.weight = torch.nn.Parameter(norm_weight(hidden_size, config))
        if config.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.eps, self.zero_centered)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """Qwen's RMSNorm: the statistics in fp32, the scale in the input's dtype. ``zero_centered`` (Qwen3.5,
    Gemma): the scale is (1 + weight), applied in fp32 before the cast back, as transformers computes it."""
    input_dtype = hidden_states.dtype
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (x * (1.0 + weight.float())).to(input_dtype)
    return weight * x.to(input_dtype)


def norm_weight(channels: int, config: TransformerConfig) -> torch.Tensor:
    """A norm's initial weight: the identity scale, ones (zeros where the scale is 1 + weight)."""
    fill = 0.0 if config.layernorm_zero_centered_gamma else 1.0
    return torch.full((channels,), fill, dtype=config.params_dtype)


class RMSNormColumnParallelLinear(ColumnParallelLinear):
    """RMSNorm, then a column-parallel linear, in one module whose weights are named as Transformer
    Engine's ``TELayerNormColumnParallelLinear`` names them (``weight``, ``bias``,
    ``layer_norm_weight``), so local and TE blocks share one checkpoint layout.

    The norm runs on this rank's tokens before the linear's sequence-parallel all-gather (a norm is
    per token, so this equals norming the gathered sequence); its weight is then marked
    ``sequence_parallel`` for the TP gradient all-reduce, as TE marks its own.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 norm_eps: float | None = None, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        # A norm of its own epsilon (DeepSeek's latent norms: 1e-6 whatever rms_norm_eps); else the config's.
        self.norm_eps = config.layernorm_epsilon if norm_eps is None else norm_eps
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.layer_norm_weight = torch.nn.Parameter(norm_weight(input_size, config))
        if config.sequence_parallel:
            self.layer_norm_weight.sequence_parallel = True

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        normed = rms_norm(input_, self.layer_norm_weight, self.norm_eps, self.zero_centered)
        return super().forward(normed, *args, **kwargs)


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """LayerNorm (weight and bias), then a column-parallel linear; the local twin of TE's
    ``TELayerNormColumnParallelLinear`` with ``normalization="LayerNorm"``.

    The norm runs on the whole input before the linear's TP copy, whose backward all-reduces the
    input gradient, so the norm's gradients are whole and equal on every TP rank.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.norm_eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            self.layer_norm_weight.sequence_parallel = True
            self.layer_norm_bias.sequence_parallel = True

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        normed = F.layer_norm(input_, (input_.shape[-1],), self.layer_norm_weight, self.layer_norm_bias,
                              self.norm_eps)
        return super().forward(normed, *args, **kwargs)


@dataclass(frozen=True)
class BlockModules:
    """The modules one pre-norm transformer block (and the projector MLP) is built from."""

    backend: str
    norm_column_linear: type  # the pre-norm fused with the linear after it (qkv, fc1)
    column_linear: type
    row_linear: type
    core_attention: type
    # The gated delta rule of linear-attention layers (``models.decoder.linear_attention``'s signature); None in
    # models without such layers, which never import its GPU kernel (fla's import registers a few dozen
    # custom ops: ~12 s of every process's start on the H200 machine, docs/benchmarks/gpu.md).
    linear_attention: Optional[Callable[..., torch.Tensor]] = None
    # The routed experts (``resolve_experts``): "grouped" or "sequential"; None in a model without experts.
    experts: Optional[str] = None

    @property
    def experts_module(self) -> type:
        """The routed experts' module class (megatron's MoE layer builds it with its experts' arguments)."""
        return _EXPERT_MODULES[self.experts or "sequential"]

    def describe(self) -> str:
        text = _DESCRIPTIONS[self.backend]
        if self.experts is not None:
            text += f"; experts: {self.experts}"
        if self.linear_attention is not None:
            text += "; gated delta rule: " + ("fla" if self.linear_attention is linear_attention.fla_chunked
                                              else "torch")
        return f"{self.backend} ({text})"


_DESCRIPTIONS = {
    "te": "TE norm-linear, TE linears, TE attention",
    "flash": "local norm-linear and linears, flash-attn varlen attention",
    "varlen": "local norm-linear and linears, torch varlen attention per packed row",
    "sdpa": "local norm-linear and linears, torch SDPA attention per packed segment",
}


def _import_problem(module_name: str) -> str | None:
    """Why ``module_name`` cannot be used: "not installed", or how its import failed; None when it
    imports."""
    if importlib.util.find_spec(module_name) is None:
        return "not installed"
    try:
        # lazy: a GPU package is imported only where a CUDA run may use it. An installed but broken
        # build (a CUDA or torch version mismatch) raises anything from ImportError to OSError.
        importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - every failure means "cannot use it", said in one line
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        return f"installed but does not import ({type(exc).__name__}: {detail})"
    return None


def _unusable_reason(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run on ``device`` at ``dtype``; None when it can."""
    if backend == "sdpa":
        return None
    if device.type != "cuda":
        return f"needs a CUDA device (the run's device is {device.type})"
    package = _PACKAGES[backend]
    problem = _import_problem(package)
    if problem == "not installed":
        return f"needs the {package} package ({_REMEDIES[backend]})"
    if problem is not None:
        return f"needs the {package} package, which is {problem}"
    if backend in ("flash", "varlen") and dtype not in _FLASH_DTYPES:
        return (f"needs fp16 or bf16 weights, not {str(dtype).removeprefix('torch.')} "
                "(flash attention kernels have no fp32; set training.precision=bf16)")
    return None


def passed_over_backends(requested: str, device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """One line for each backend ``auto`` passed over although its package is installed (a broken
    GPU install looks like a slow run otherwise); empty for an explicit choice."""
    device = torch.device(device)
    if requested != "auto" or device.type != "cuda":
        return []
    chosen = resolve_layer_backend(requested, device, dtype)
    lines = []
    for backend in _AUTO_ORDER[:_AUTO_ORDER.index(chosen)]:
        reason = _unusable_reason(backend, device, dtype)
        if _import_problem(_PACKAGES[backend]) != "not installed":
            lines.append(f"model.layer_backend=auto: {backend} {reason}; using {chosen}")
    return lines


def resolve_layer_backend(requested: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """``model.layer_backend`` -> ``te``, ``flash`` or ``sdpa`` for this device and dtype.

    ``auto`` takes the first that can run; an explicit choice that cannot run is a ConfigError
    naming the key, never a silent fallback.
    """
    if requested not in LAYER_BACKENDS:
        raise ConfigError(f"model.layer_backend={requested!r} is not one of {', '.join(LAYER_BACKENDS)}")
    device = torch.device(device)
    if requested == "auto":
        return next(b for b in _AUTO_ORDER if _unusable_reason(b, device, dtype) is None)
    reason = _unusable_reason(requested, device, dtype)
    if reason is not None:
        raise ConfigError(f"model.layer_backend={requested!r} {reason}; use sdpa or auto")
    return requested


def resolve_experts(requested: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """``model.language.moe.experts`` -> ``grouped`` or ``sequential`` for this device and dtype (see the
    module docstring); an explicit ``grouped`` that cannot run is a ConfigError naming the key."""
    if requested not in EXPERT_KINDS:
        raise ConfigError(f"{_EXPERTS_KEY}={requested!r} is not one of {', '.join(EXPERT_KINDS)}")
    on_cuda = torch.device(device).type == "cuda"
    if requested == "auto":
        return "grouped" if on_cuda and dtype == torch.bfloat16 else "sequential"
    if requested == "grouped" and on_cuda and dtype != torch.bfloat16:
        raise ConfigError(f"{_EXPERTS_KEY}=grouped on CUDA needs bf16 weights (torch._grouped_mm), not "
                          f"{str(dtype).removeprefix('torch.')}; set training.precision=bf16 or use sequential")
    return requested


def block_modules(backend: str, device: torch.device | str = "cpu", *,
                  linear_attention_layers: bool = False, experts: Optional[str] = None) -> BlockModules:
    """The modules of a resolved backend (see ``resolve_layer_backend``) on ``device``; with the gated delta
    rule for ``device`` where the model has linear-attention layers; ``experts``: the resolved routed experts
    (``resolve_experts``; None: a model without experts)."""
    rule = linear_attention_rule(device) if linear_attention_layers else None
    if backend == "te":
        # Imported only here: importing it needs transformer_engine.
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TEDotProductAttention,
            TELayerNormColumnParallelLinear,
            TERowParallelLinear,
        )

        return BlockModules("te", TELayerNormColumnParallelLinear, TEColumnParallelLinear,
                            TERowParallelLinear, TEDotProductAttention, rule, experts)
    if backend in _ATTENTION:
        return BlockModules(backend, RMSNormColumnParallelLinear, ColumnParallelLinear,
                            RowParallelLinear, _ATTENTION[backend], rule, experts)
    raise ValueError(f"unresolved layer backend {backend!r}; call resolve_layer_backend first")


def linear_attention_rule(device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The gated delta rule of linear-attention layers on ``device``, whatever the attention backend: fla's
    Triton kernel on CUDA where ``flash-linear-attention`` imports (the ``gpu`` extra), else the plain-torch
    chunked rule (the same math; on CUDA slower)."""
    if torch.device(device).type == "cuda" and _import_problem("fla") is None:
        return linear_attention.fla_chunked
    return linear_attention.chunked


def layer_norm_modules(modules: BlockModules) -> BlockModules:
    """The run's block modules with a LayerNorm (weight and bias) pre-norm, for towers whose blocks
    use one (TE's norm-linear already follows the config's ``normalization``)."""
    if modules.backend == "te":
        return modules
    return dataclasses.replace(modules, norm_column_linear=LayerNormColumnParallelLinear)
