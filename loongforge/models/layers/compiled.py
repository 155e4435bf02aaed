"""``training.compile``: the small elementwise functions of a block run through ``torch.compile``.

Four parts, each one function (or a pair) that reads and writes whole activations a few times in eager mode,
where inductor fuses it into one kernel per direction:

- ``norm``: loongforge's RMSNorm (``layer_backend.rms_norm``: fp32 statistics, cast, scale), every pre-norm,
  q/k norm and final norm;
- ``rope``: megatron-core's rotary application (``rope_utils._apply_rotary_pos_emb_bshd``: cos/sin, rotate-half,
  two multiplies; packed rows reach it once per segment through ``_apply_rotary_pos_emb_thd``);
- ``swiglu``: the MLPs' gated unit silu(gate) * up. megatron's MLP computes it eagerly unless
  ``bias_activation_fusion`` is set, where it calls its own ``bias_swiglu_impl`` (forward and the hand-written
  backward decorated with ``jit_fuser``, i.e. ``torch.compile`` on first call: ``parallel.mcore_jit``): the part
  turns that flag on for every gated SiLU MLP built while it is installed (dense MLPs, sequential experts, the
  shared expert), and compiles the grouped experts' activation;
- ``permute``: megatron-core's MoE ``permute`` / ``unpermute`` (``moe_utils``; the all-to-all dispatcher's
  sort of tokens to expert order and back). Its sort is data-dependent (``masked_select``), so it compiles in
  pieces (not ``fullgraph``).

Each is compiled lazily (on its first call, ``mcore_jit.lazy_compile``) with ``dynamic=True``: packed rows change
length every step, and a shape-specialised graph would recompile each time.

``auto`` is ``off`` on the CPU: measured there (``tests/models/test_compiled.py`` prints it, docs/benchmarks/
compile.md), compiling costs ~10-30 CPU-s per part per process and the compiled functions are not faster than
eager at training shapes. On CUDA ``auto`` is ``on``: fusing memory-bound elementwise chains is what inductor
does on a GPU; the GPU check (``scripts/gpu_check.py``, step ``compile``) measures it, and the figure is owed
until a GPU run records it.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from loongforge.parallel import mcore_patches
from loongforge.parallel.mcore_jit import lazy_compile

COMPILE_MODES = ("auto", "on", "off")
PARTS = ("norm", "rope", "swiglu", "permute")
# torch.compile's options: shapes symbolic from the first call (packed rows of every length, one graph).
_OPTIONS = dict(dynamic=True, fullgraph=True)
_PIECEWISE = dict(dynamic=True)  # a data-dependent output size (masked_select) breaks the graph there


def compile_parts(mode: str, device: torch.device) -> tuple[str, ...]:
    """The parts ``training.compile`` compiles on ``device``: all on ``on``, none on ``off``; ``auto``: all on
    CUDA, none on the CPU (see the module docstring)."""
    if mode == "on" or (mode == "auto" and torch.device(device).type == "cuda"):
        return PARTS
    return ()


def compile_note(mode: str, device: torch.device) -> str:
    """The run log's line: what ``training.compile`` compiles on ``device``."""
    parts = compile_parts(mode, device)
    return f"compile: {mode}: " + (f"torch.compile of {', '.join(parts)}" if parts else "eager")


def _compiled(options: dict) -> Callable[[Callable], Callable]:
    return lambda original: lazy_compile(original, **options)


def _fused_swiglu_mlp(original: Callable) -> Callable:
    """``MLP.__init__`` that, for a gated SiLU without clamp or offset, gives the MLP a copy of its config with
    ``bias_activation_fusion``: megatron then calls its compiled ``bias_swiglu_impl`` (silu(y1) * y2, the same
    math) instead of the eager closure. The copy keeps every other MLP (a GELU tower's) on the shared config."""

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        swiglu = (self.config.gated_linear_unit and self.activation_func is F.silu
                  and self.config.activation_func_clamp_value is None and self.config.glu_linear_offset == 0.0
                  and not self.config.use_te_activation_func)
        if swiglu and not self.config.bias_activation_fusion:
            self.config = copy.copy(self.config)  # no __post_init__: the same config with one flag set
            self.config.bias_activation_fusion = True

    return __init__


PATCHES: dict[str, list[mcore_patches.Patch]] = {
    "norm": [mcore_patches.Patch(
        name="compile_rms_norm", owner_path="loongforge.models.layers.layer_backend", attribute="rms_norm",
        why="RMSNorm's fp32 statistics, cast and scale: one fused kernel each way", wrap=_compiled(_OPTIONS))],
    "rope": [mcore_patches.Patch(
        name="compile_rope", owner_path="megatron.core.models.common.embeddings.rope_utils",
        attribute="_apply_rotary_pos_emb_bshd", why="the rotary application's cos/sin/rotate-half chain",
        wrap=_compiled(_OPTIONS))],
    "swiglu": [
        mcore_patches.Patch(
            name="compile_swiglu_mlp", owner_path="megatron.core.transformer.mlp:MLP", attribute="__init__",
            why="megatron's MLP computes silu(gate) * up eagerly unless bias_activation_fusion selects its "
                "torch.compile'd bias_swiglu_impl", wrap=_fused_swiglu_mlp),
        mcore_patches.Patch(
            name="compile_grouped_swiglu", owner_path="loongforge.models.layers.grouped_experts",
            attribute="swiglu", why="the grouped experts' gated unit", wrap=_compiled(_OPTIONS)),
    ],
    "permute": [
        mcore_patches.Patch(
            name="compile_moe_permute", owner_path="megatron.core.transformer.moe.moe_utils", attribute="permute",
            why="the dispatcher's sort of tokens to expert order", wrap=_compiled(_PIECEWISE)),
        mcore_patches.Patch(
            name="compile_moe_unpermute", owner_path="megatron.core.transformer.moe.moe_utils",
            attribute="unpermute", why="the combine's weighted scatter back to token order",
            wrap=_compiled(_PIECEWISE)),
    ],
}


def patches(parts: Iterable[str]) -> list[mcore_patches.Patch]:
    return [patch for part in parts for patch in PATCHES[part]]


def apply(parts: Iterable[str]) -> list[str]:
    """Compile exactly ``parts`` from here on: their patches installed, the other parts' removed (a second run in
    the same process, a test's, must not keep the first one's choice). Before the model is built: the SwiGLU part
    acts at construction. Returns the names this call installed."""
    parts = tuple(parts)
    mcore_patches.remove(patches(part for part in PARTS if part not in parts))
    return mcore_patches.apply(patches(parts))
