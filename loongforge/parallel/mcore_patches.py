"""The one registry of loongforge's patches to megatron-core: declared, scoped and revertible.

Two groups, each applied for a reason the caller states, never process-wide by default:

* ``CPU_PATCHES`` (with ``DEVICE_PROXY_MODULES``): megatron-core 0.16.1 assumes CUDA in a handful of
  places (see docs/megatron-cpu.md): it moves RoPE frequencies to ``torch.cuda.current_device()``,
  calls ``Tensor.cuda()`` before some all-reduces, and so on. Each patch wraps one megatron-core
  callable so that *while it runs* CUDA device queries resolve to the CPU (``cpu_device_scope``).
  ``apply_cpu()`` installs them because the run's device is the CPU (``training.device=cpu``, or
  ``auto`` without CUDA), whether or not a GPU is visible; a CUDA run never calls it and runs
  megatron-core untouched. One CPU patch is numerical, not about devices: the grad norm accumulates
  in float64 (megatron's float32 fallback drifted with the TP shard size, ``_float64_l2_norm``).
* ``FIX_PATCHES``: megatron-core defects a model meets on any device (the expert bias's count of padded
  rows, ``_expert_bias_counts``); ``apply_fixes()``, by every model build.
* ``NO_TE_PATCHES``: megatron-core's MoE router linear assumes Transformer Engine imported
  (``_router_gating_without_te``); part of ``CPU_PATCHES``, and installed alone by
  ``apply_without_te()`` for a CUDA run without TE.
* ``CHECKPOINT_LOAD_PATCHES``: fixes needed only while a checkpoint is read, on any device;
  ``scoped(CHECKPOINT_LOAD_PATCHES)`` installs them for the duration of the load and restores the
  originals afterwards, even on error.
* ``CHECKPOINT_SAVE_PATCHES``: while a checkpoint is written, megatron-core's torch_dist writer
  writes its files from threads of the saving process instead of forked writer processes that
  report through a ``multiprocessing`` Manager (a spawned server process, ~280 MB, that megatron
  keeps for the life of the process, plus the resource tracker spawning starts). Those processes
  outlived a killed or signalled run, and a rank killed mid-save left its forked writer (~850 MB)
  behind; threads die with the rank. Saving is synchronous either way.

One adjustment is not here because it must precede megatron-core's import, not wrap what it
imported: ``mcore_jit`` (installed by ``import loongforge``) defers megatron's ``torch.compile``
decorations to the first call, so that importing megatron-core imports no ``torch._dynamo``.

Add a patch by appending a ``Patch`` to a group with a name, the owner (class or module), the
attribute, a one-line reason and a wrapper factory. Installing is idempotent; ``revert()`` restores
every original (tests use it).

Sites that allocate with a literal ``device="cuda"`` (DDP buffers, optimizer flags, grad-norm
buffers, schedule token counters, checkpoint exchange) cannot be reached by a scope: for those, the
modules in ``DEVICE_PROXY_MODULES`` get a module-local ``torch`` whose tensor factories map a CUDA
device to the CPU. Other modules, and user code, keep the real torch.

The scope swaps process-global attributes of ``torch`` for the duration of the wrapped call, so it
is not thread-safe; megatron-core builds and runs models on the main thread, which is all we need.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import queue
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

__all__ = ["Patch", "CPU_PATCHES", "NO_TE_PATCHES", "FIX_PATCHES", "CHECKPOINT_LOAD_PATCHES",
           "CHECKPOINT_SAVE_PATCHES", "DEVICE_PROXY_MODULES", "apply", "remove", "apply_cpu", "apply_without_te", "apply_fixes", "scoped", "revert", "applied",
           "cpu_device_scope", "run_in_cpu_device_scope"]

# CPU tensors reported under their CUDA type names, for megatron's ``param.type() == ...`` checks.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def cpu_device_scope() -> Iterator[None]:
    """Inside: ``torch.cuda.current_device()`` is the CPU, ``Tensor.cuda()`` keeps tensors on the CPU,
    ``torch.cuda.synchronize()`` does nothing and ``Tensor.type()`` names CPU float tensors as CUDA
    ones. Re-entrant: restores whatever was there before."""
    saved = (torch.cuda.current_device, torch.Tensor.cuda, torch.cuda.synchronize, torch.Tensor.type)
    original_type = torch.Tensor.type

    def type_as_cuda(self, *args, **kwargs):
        name = original_type(self, *args, **kwargs)
        return _CUDA_TYPE_NAMES.get(name, name) if not args and not kwargs else name

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.type = type_as_cuda
    try:
        yield
    finally:
        (torch.cuda.current_device, torch.Tensor.cuda, torch.cuda.synchronize,
         torch.Tensor.type) = saved


def run_in_cpu_device_scope(original: Callable) -> Callable:
    """Wrapper factory: call ``original`` inside ``cpu_device_scope``."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with cpu_device_scope():
            return original(*args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class Patch:
    """One megatron-core callable to wrap. ``owner_path`` is imported lazily so that listing the
    patches costs nothing and a missing module (other megatron-core versions) fails loudly."""

    name: str
    owner_path: str  # "package.module:Class" or "package.module"
    attribute: str
    why: str
    wrap: Callable[[Callable], Callable] = run_in_cpu_device_scope

    def owner(self) -> Any:
        module_name, _, class_name = self.owner_path.partition(":")
        owner = importlib.import_module(module_name)
        return getattr(owner, class_name) if class_name else owner


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _ignore_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def _float64_l2_norm(original: Callable) -> Callable:
    """The grad-norm kernel (``l2_norm_impl``) accumulating in float64.

    Without apex or Transformer Engine megatron-core computes the norm with
    ``local_multi_tensor_l2_norm``: ``torch.norm`` per gradient, in float32. On the CPU that
    reduction loses precision with the tensor's length (measured: -2.6e-5 relative on the tiny
    preset's 19.4M-element embedding gradient, -1.1e-5 on the whole norm), and the error depends on
    how the tensor is sharded, so clipping and the logged norm changed with the TP layout while the
    gradients agreed to 1e-7. Accumulated in float64, the same gradients give the same norm at every
    layout (measured within 1e-7 of TP 1 at TP 2, TP 4, PP 2 and DP 2).
    Same contract as apex's kernel: ``(norm tensor [1], per-tensor norms or None)``.
    """

    @functools.wraps(original)
    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        if per_tensor:  # megatron's grad norm never asks for per-tensor norms
            return original(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
        squares = torch.zeros(1, dtype=torch.float64)
        for tensor in tensor_lists[0]:
            squares += torch.linalg.vector_norm(tensor, dtype=torch.float64).square()
        return squares.sqrt(), None

    return l2_norm


def _norm_without_gradients(original: Callable) -> Callable:
    """``get_grad_norm_fp32`` on a rank that holds no gradient (a pipeline stage with nothing to
    train: LoRA on the projector alone, training.freeze_language) joins the norm's all-reduce with
    the float64 zero ``_float64_l2_norm`` gives the other ranks, not megatron-core's float32 zero
    (clip_grads.py:114), whose size the others' float64 would not match (gloo aborts the job)."""

    @functools.wraps(original)
    def grad_norm(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        empty = not isinstance(grads_for_norm, torch.Tensor) and not list(grads_for_norm)
        if empty and float(norm_type) == 2.0:
            grads_for_norm = [torch.zeros(1)]
        return original(grads_for_norm, norm_type, grad_stats_parallel_group)

    return grad_norm


def _router_gating_without_te(original: Callable) -> Callable:
    """The MoE router's logits (``router_gating_linear``) where Transformer Engine is absent.

    megatron-core 0.16.1's ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``,
    but ``moe_utils`` binds that name only when TE imports (moe_utils.py:22-39), so without TE
    every router forward raises NameError (a GPU run without TE too). Without the name this computes
    what its torch fallback would: ``input @ weight.T (+ bias)`` in the router dtype, with plain
    autograd. With TE present the original runs.
    """

    @functools.wraps(original)
    def gating_linear(inp, weight, bias, router_dtype):
        if "te_general_gemm" in vars(sys.modules[original.__module__]):
            return original(inp, weight, bias, router_dtype)
        bias = None if bias is None else bias.to(router_dtype)
        return torch.nn.functional.linear(inp.to(router_dtype), weight.to(router_dtype), bias)

    return gating_linear


def _host_split_sizes(original: Callable) -> Callable:
    """The all-to-all dispatcher's device-to-host copy (``maybe_move_tensor_to_cpu``) for tensors
    already on the host.

    The dispatcher counts tokens per rank on the device and copies the counts to the host as numpy
    arrays (``as_numpy``), the form ``all_to_all_single`` takes as split sizes; megatron-core skips
    the copy, and so the conversion, for a tensor that is not on CUDA, and torch then refuses the
    tensor as split sizes. On the host this does the conversion the device path would have done.
    """

    @functools.wraps(original)
    def move_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move_to_host


# Needed wherever Transformer Engine is absent, on any device (``apply_without_te``); part of the
# CPU group too (TE never runs on the CPU).
class _AbsentTELinear:
    """Stands for Transformer Engine's ``TELinear`` where TE is absent: no module is one."""


NO_TE_PATCHES: list[Patch] = [
    Patch(
        name="moe_router_gating_linear",
        owner_path="megatron.core.transformer.moe.moe_utils",
        attribute="router_gating_linear",
        why="without Transformer Engine the router's linear reads an unbound te_general_gemm (moe_utils.py:1192)",
        wrap=_router_gating_without_te,
    ),
    Patch(
        name="mla_te_linear_stand_in",
        owner_path="megatron.core.transformer.multi_latent_attention",
        attribute="TELinear",
        why="without Transformer Engine megatron's TELinear is a MagicMock, which multi-latent attention's "
            "isinstance check refuses (multi_latent_attention.py:185)",
        wrap=lambda original: _AbsentTELinear,
    ),
]

def _eager_output_gate(original: Callable) -> Callable:
    def apply_output_gate(self, x, gate):  # megatron's math, x * sigmoid(gate) in fp32, without torch.compile
        return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)

    return apply_output_gate


def _expert_bias_counts(original: Callable) -> Callable:
    def apply_expert_bias(self, routing_map, padding_mask=None):
        """megatron's count of the step's tokens per expert (for the expert bias), the padding mask [T]
        broadcast over the experts of routing_map [T, E], eagerly."""
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    return apply_expert_bias


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group``."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


# Inside multi-latent attention's q/k/v computation at TP > 1 with column-parallel latent projections:
# [TP group, rotary applications so far] (the query's is the first, the shared key's the second).
_MLA_ROTARY: list = []


def _mla_rotary_scope(original: Callable) -> Callable:
    def get_query_key_value_tensors(self, *args, **kwargs):
        # lazy: this module imports no megatron-core at import time (patches wrap modules already imported)
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        group = self.pg_collection.tp
        sharded = group.size() > 1 and isinstance(self.linear_kv_down_proj, ColumnParallelLinear)
        if not sharded:
            return original(self, *args, **kwargs)
        _MLA_ROTARY.append([group, 0])
        try:
            return original(self, *args, **kwargs)
        finally:
            _MLA_ROTARY.pop()

    return get_query_key_value_tensors


def _mla_shared_key_grad(original: Callable) -> Callable:
    def apply_rotary_pos_emb(t, *args, **kwargs):
        if _MLA_ROTARY:
            scope = _MLA_ROTARY[-1]
            scope[1] += 1
            if scope[1] == 2:  # the shared rotary key, used by every rank's heads
                t = _SumGradOverGroup.apply(t, scope[0])
        return original(t, *args, **kwargs)

    return apply_rotary_pos_emb


# megatron-core defects a model meets on any device (``apply_fixes``, by every model build).
FIX_PATCHES: list[Patch] = [
    Patch(
        name="mla_rotary_scope",
        owner_path="megatron.core.transformer.multi_latent_attention:MLASelfAttention",
        attribute="get_query_key_value_tensors",
        why="with column-parallel latent projections at TP > 1 (megatron's local spec) the shared rotary key is "
            "gathered and used by each rank's own heads, but the gather's backward only splits its gradient "
            "(multi_latent_attention.py:607): each rank's rotary rows of linear_kv_down_proj saw its own heads' "
            "share; this marks the scope in which _mla_shared_key_grad sums it over TP",
        wrap=_mla_rotary_scope,
    ),
    Patch(
        name="mla_shared_key_grad",
        owner_path="megatron.core.transformer.multi_latent_attention",
        attribute="apply_rotary_pos_emb",
        why="the shared rotary key's gradient summed over TP before the gather's split (see mla_rotary_scope); "
            "other callers pass through untouched",
        wrap=_mla_shared_key_grad,
    ),
    Patch(
        name="expert_bias_padding_mask",
        owner_path="megatron.core.transformer.moe.router:TopKRouter",
        attribute="_apply_expert_bias",
        why="ands routing_map [T, E] with the padding mask [T], which fails to broadcast, under torch.compile "
            "(moe/router.py:542): every run of the expert bias with padded rows would stop",
        wrap=_expert_bias_counts,
    ),
]


CPU_PATCHES: list[Patch] = [
    # Model side.
    Patch(
        name="attention_output_gate_compile",
        owner_path="megatron.core.transformer.attention:Attention",
        attribute="_apply_output_gate",
        why="gated attention's output gate is torch.compile'd (attention.py:1217): on the CPU a C++ build per "
            "process for one multiply",
        wrap=_eager_output_gate,
    ),
    Patch(
        name="rope_inv_freq",
        owner_path="megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding",
        attribute="get_emb",
        why="moves inv_freq to torch.cuda.current_device() at first forward (rotary_pos_embedding.py:162)",
    ),
    Patch(
        name="mrope_inv_freq",
        owner_path="megatron.core.models.common.embeddings.rotary_pos_embedding:MultimodalRotaryEmbedding",
        attribute="__init__",
        why="creates inv_freq on torch.cuda.current_device() at construction (rotary_pos_embedding.py:297)",
    ),
    Patch(
        name="rope_init",
        owner_path="megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding",
        attribute="__init__",
        why="multi-latent attention builds its plain RoPE without use_cpu_initialization: inv_freq on "
            "torch.cuda.current_device() (rotary_pos_embedding.py:86, multi_latent_attention.py:130)",
    ),
    Patch(
        name="yarn_rope_init",
        owner_path="megatron.core.models.common.embeddings.yarn_rotary_pos_embedding:YarnRotaryEmbedding",
        attribute="__init__",
        why="multi-latent attention builds YaRN's frequencies on torch.cuda.current_device() "
            "(yarn_rotary_pos_embedding.py:76)",
    ),
    Patch(
        name="yarn_rope_inv_freq",
        owner_path="megatron.core.models.common.embeddings.yarn_rotary_pos_embedding:YarnRotaryEmbedding",
        attribute="get_emb",
        why="moves YaRN's frequencies to torch.cuda.current_device() at first forward "
            "(yarn_rotary_pos_embedding.py:120-126)",
    ),
    Patch(
        name="mtp_loss_tracker",
        owner_path="megatron.core.transformer.multi_token_prediction:MTPLossLoggingHelper",
        attribute="save_loss_to_tracker",
        why="the multi-token-prediction loss tracker is created on torch.cuda.current_device() "
            "(multi_token_prediction.py:336)",
    ),
    Patch(
        name="tied_embedding_sync",
        owner_path="megatron.core.models.common.language_module.language_module:LanguageModule",
        attribute="setup_embeddings_and_output_layer",
        why="weight.data.cuda() before all-reducing tied embeddings, PP > 1 (language_module.py:244)",
    ),
    Patch(
        name="moe_router_gating",
        owner_path="megatron.core.transformer.moe.router:Router",
        attribute="gating",
        why="moves a router weight it finds on the CPU to torch.cuda.current_device() at every forward "
            "(moe/router.py:88-92)",
    ),
    *NO_TE_PATCHES,
    Patch(
        name="moe_dispatch_split_sizes",
        owner_path="megatron.core.transformer.moe.token_dispatcher",
        attribute="maybe_move_tensor_to_cpu",
        why="the all-to-all dispatcher's split sizes stay tensors on the host, which all_to_all_single "
            "refuses (token_dispatcher.py:879-886)",
        wrap=_host_split_sizes,
    ),
    Patch(
        name="moe_router_buffers",
        owner_path="megatron.core.transformer.moe.router:TopKRouter",
        attribute="__init__",
        why="expert-bias and global aux-loss buffers created on torch.cuda.current_device() (moe/router.py:166-198)",
    ),
    # Training side.
    Patch(
        name="float16_optimizer_param_types",
        owner_path="megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params",
        attribute="__init__",
        why="sorts params by param.type() == 'torch.cuda.*Tensor' names (optimizer.py:671/690)",
    ),
    Patch(
        name="distributed_optimizer_param_types",
        owner_path="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
        attribute="_build_model_and_main_param_groups",
        why="sorts params by param.type() == 'torch.cuda.*Tensor' names (distrib_optimizer.py:361/420)",
    ),
    Patch(
        name="distributed_optimizer_gather",
        owner_path="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
        attribute="get_parameter_state_dp_zero",
        why="send_tensor.cuda() while gathering optimizer state for a checkpoint (distrib_optimizer.py:1089)",
    ),
    Patch(
        name="recompute_cuda_rng_get",
        owner_path="megatron.core.tensor_parallel.random",
        attribute="_get_cuda_rng_state",
        why="activation recompute saves the CUDA RNG state (random.py:447); the CPU state is saved too",
        wrap=lambda original: _no_cuda_rng_state,
    ),
    Patch(
        name="recompute_cuda_rng_set",
        owner_path="megatron.core.tensor_parallel.random",
        attribute="_set_cuda_rng_state",
        why="activation recompute restores the CUDA RNG state before re-running a layer (random.py:457)",
        wrap=lambda original: _ignore_cuda_rng_state,
    ),
    Patch(
        name="grad_norm_float64",
        owner_path="megatron.core.optimizer.clip_grads",
        attribute="l2_norm_impl",
        why="local_multi_tensor_l2_norm's float32 torch.norm drifts 1e-5 with the TP shard size (utils.py:1205)",
        wrap=_float64_l2_norm,
    ),
    Patch(
        name="grad_norm_without_gradients",
        owner_path="megatron.core.optimizer.optimizer",
        attribute="get_grad_norm_fp32",
        why="a rank without gradients all-reduces a float32 zero against the others' float64 norm (clip_grads.py:114)",
        wrap=_norm_without_gradients,
    ),
    Patch(
        name="clip_grads_grad_type",
        owner_path="megatron.core.optimizer.clip_grads",
        attribute="clip_grad_by_total_norm_fp32",
        why="asserts grad.type() == 'torch.cuda.FloatTensor' (clip_grads.py:167)",
    ),
]

# megatron-core modules that allocate with a literal device="cuda" or torch.cuda.current_device();
# each gets a module-local torch whose factories allocate on the CPU instead.
DEVICE_PROXY_MODULES: list[str] = [
    "megatron.core.distributed.param_and_grad_buffer",  # grad buffers (:768/783/800/806)
    "megatron.core.distributed.distributed_data_parallel",  # communication stream (:230)
    "megatron.core.optimizer.optimizer",  # found_inf / loss-scale tensors (:473/481/485/907/1141)
    "megatron.core.optimizer.distrib_optimizer",  # shard buffers (:791)
    "megatron.core.optimizer.clip_grads",  # grad-norm buffers (:90/103/115/174/207)
    "megatron.core.utils",  # local multi-tensor l2-norm fallback
    "megatron.core.tensor_parallel.mappings",  # sequence-parallel gather/scatter buffers (:181)
    "megatron.core.tensor_parallel.layers",  # sequence-parallel all-gather in linear backward (:552)
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens (:596/983/2138)
    "megatron.core.pipeline_parallel.p2p_communication",  # receive buffers, synchronize (:190-398)
    "megatron.core.dist_checkpointing.exchange_utils",  # load-time exchange buffers (:104/326/499)
    "megatron.core.dist_checkpointing.strategies.async_utils",  # writer liveness flags (:165/604)
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # synchronize (:230)
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # plan-reuse flags (:204/252)
    "megatron.core.dist_checkpointing.strategies.fully_parallel",  # synchronize (:271/281)
    # The all-to-all MoE dispatcher's device-to-host side stream, made at construction (:445) and
    # entered, waited on and synchronised at every dispatch (:871-900).
    "megatron.core.transformer.moe.token_dispatcher",
    # The shared expert's side stream under moe_shared_expert_overlap (EP > 1), made at construction (:123) and
    # entered and waited on by each overlapped piece the dispatcher calls (:162-277).
    "megatron.core.transformer.moe.shared_experts",
]

_TENSOR_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like",
                     "empty_like", "full_like", "rand", "randn")


def _cpu_instead_of_cuda(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):  # a CUDA ordinal
        return torch.device("cpu")
    return torch.device("cpu") if torch.device(device).type == "cuda" else device


class _HostStream:
    """A CUDA stream's stand-in where all work runs in order on the host: nothing to wait for."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> "_HostStream":
        return self  # an event whose synchronize() returns at once

    def synchronize(self) -> None:
        return None


_HOST_STREAM = _HostStream()


class _CudaOnCpu(types.SimpleNamespace):
    """``torch.cuda`` as the proxied modules see it: the current device is the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """A module-local ``torch`` whose tensor factories never allocate on CUDA."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu(
            current_device=lambda: torch.device("cpu"),
            synchronize=lambda *args, **kwargs: None,
            empty_cache=lambda: None,
            default_stream=lambda *args, **kwargs: None,
            stream=lambda *args, **kwargs: contextlib.nullcontext(),
            Stream=lambda *args, **kwargs: _HOST_STREAM,
            current_stream=lambda *args, **kwargs: _HOST_STREAM,
        )
        for name in _TENSOR_FACTORIES:
            setattr(self, name, self._on_cpu(getattr(torch, name)))

    @staticmethod
    def _on_cpu(factory: Callable) -> Callable:
        @functools.wraps(factory)
        def cpu_factory(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu_instead_of_cuda(kwargs["device"])
            return factory(*args, **kwargs)

        return cpu_factory

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

def _strict_optimizer_state_restore(original: Callable) -> Callable:
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` that copies under no_grad and
    checks the checkpoint's state names against the optimizer's.

    megatron-core 0.16.1 restores each main parameter and its Adam moments with ``copy_`` into leaf
    tensors that require grad (which raises outside no_grad) and indexes the checkpoint with every
    key of the live state. The live state may hold a ``step`` counter (torch's Adam keeps one per
    parameter; the checkpoint stores steps with the parameter groups), which is not a tensor to
    restore here. Any other difference is a real mismatch (a checkpoint of another optimizer) and
    raises, naming both key sets.
    """

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)  # TE's own scaled-state setter: no copy_
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        live = {"param": main_param, **self.optimizer.state[main_param]}
        live.pop("step", None)
        if set(live) != set(tensors):
            raise RuntimeError(
                f"optimizer state mismatch for a parameter of shape {list(model_param.shape)}: the "
                f"checkpoint holds {sorted(tensors)}, this optimizer ({type(self.optimizer).__name__}) "
                f"holds {sorted(live)}; resume with the optimizer the checkpoint was written with")
        with torch.no_grad():
            for key, source in tensors.items():
                live[key].copy_(source)

    return set_states


CHECKPOINT_LOAD_PATCHES: list[Patch] = [
    Patch(
        name="distributed_optimizer_state_restore",
        owner_path="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
        attribute="_set_main_param_and_optimizer_states",
        why="copy_ into grad-requiring leaves, and a KeyError on Adam's step (distrib_optimizer.py:940)",
        wrap=_strict_optimizer_state_restore,
    ),
]

def _in_process_results_queue(original: Callable) -> Callable:
    """``_get_write_results_queue`` returning a plain queue: the writer threads share the process."""

    @functools.wraps(original)
    def results_queue() -> queue.Queue:
        return queue.Queue()

    return results_queue


def _write_buckets_in_threads(original: Callable) -> Callable:
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` with one thread per file instead of
    one forked process; results travel the same way (a ``{bucket index: results}`` dict, or the
    first exception, put on the results queue), so megatron's finalisation is unchanged."""
    # lazy: the patch list names megatron-core modules without importing them
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    @functools.wraps(original)
    def write(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
        local_results, count_queue = queue.Queue(), queue.Queue()
        threads = []
        for index, bucket in enumerate(write_buckets):
            count_queue.put(index)  # write_preloaded_data takes one entry off when it is done
            threads.append(threading.Thread(
                target=FileSystemWriterAsync.write_preloaded_data, name=f"ckpt-writer-{index}",
                args=(transform_list, index, bucket, local_results, count_queue, True),
                kwargs={"use_msc": use_msc} if use_msc else {}, daemon=True))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results = dict(local_results.get_nowait() for _ in threads)
        failure = next((value for value in results.values() if isinstance(value, Exception)), None)
        global_results_queue.put(failure if failure is not None else results)

    return write


CHECKPOINT_SAVE_PATCHES: list[Patch] = [
    Patch(
        name="checkpoint_results_queue_in_process",
        owner_path="megatron.core.dist_checkpointing.strategies.filesystem_async",
        attribute="_get_write_results_queue",
        why="a spawned multiprocessing Manager kept for the life of the process (filesystem_async.py:51)",
        wrap=_in_process_results_queue,
    ),
    Patch(
        name="checkpoint_writers_in_threads",
        owner_path="megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync",
        attribute="write_preloaded_data_multiproc",
        why="forked writer processes that outlive a rank killed mid-save (filesystem_async.py:266)",
        wrap=_write_buckets_in_threads,
    ),
]

# name -> (owner, attribute, original as stored on the owner)
_APPLIED: dict[str, tuple[Any, str, Any]] = {}
# Proxied module -> the torch it had before; other modules that imported a patched function by name.
_PROXIED: dict[str, Any] = {}
_REBOUND: list[tuple[Any, str, Callable]] = []


def _rebind_importers(attribute: str, original: Callable, wrapped: Callable) -> None:
    """megatron modules that did ``from x import f`` hold their own reference to ``f``: patch those."""
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("megatron.core") and \
                getattr(module, attribute, None) is original:
            setattr(module, attribute, wrapped)
            _REBOUND.append((module, attribute, original))


def _install(patch: Patch) -> bool:
    """Install one patch; False when it already is."""
    if patch.name in _APPLIED:
        return False
    owner = patch.owner()
    # Wrap the function itself and keep a static/class method what it was, or it would receive
    # the instance (or the class twice) as its first argument.
    stored = inspect.getattr_static(owner, patch.attribute)
    descriptor = type(stored) if isinstance(stored, (staticmethod, classmethod)) else None
    original = stored.__func__ if descriptor else getattr(owner, patch.attribute)
    wrapped = patch.wrap(original)
    setattr(owner, patch.attribute, descriptor(wrapped) if descriptor else wrapped)
    if isinstance(owner, types.ModuleType):
        _rebind_importers(patch.attribute, original, wrapped)
    _APPLIED[patch.name] = (owner, patch.attribute, stored)
    return True


def _uninstall(name: str) -> None:
    owner, attribute, stored = _APPLIED.pop(name)
    for index in reversed(range(len(_REBOUND))):
        module, rebound_attribute, original = _REBOUND[index]
        if rebound_attribute == attribute and getattr(module, attribute, None) is getattr(owner, attribute):
            setattr(module, attribute, original)
            del _REBOUND[index]
    setattr(owner, attribute, stored)


def apply_cpu() -> list[str]:
    """Install the CPU patches and device proxies; returns the patch names installed by this call.

    Call it because the run's device is the CPU. Idempotent.
    """
    installed = [patch.name for patch in CPU_PATCHES if _install(patch)]
    for module_name in DEVICE_PROXY_MODULES:
        if module_name not in _PROXIED:
            module = importlib.import_module(module_name)
            _PROXIED[module_name] = module.torch
            module.torch = _CpuTorch()
    return installed


def apply(patches: list[Patch]) -> list[str]:
    """Install ``patches`` for the rest of the process (``models.layers.compiled``); returns the names this call
    installed. Idempotent; ``revert()`` undoes them."""
    return [patch.name for patch in patches if _install(patch)]


def remove(patches: list[Patch]) -> list[str]:
    """Uninstall those of ``patches`` that are installed; returns their names."""
    removed = [patch.name for patch in patches if patch.name in _APPLIED]
    for name in reversed(removed):
        _uninstall(name)
    return removed


def apply_fixes() -> list[str]:
    """Install ``FIX_PATCHES`` (any device). Idempotent."""
    return [patch.name for patch in FIX_PATCHES if _install(patch)]


def apply_without_te() -> list[str]:
    """Install ``NO_TE_PATCHES``: a CUDA run whose process cannot import Transformer Engine. Idempotent."""
    return [patch.name for patch in NO_TE_PATCHES if _install(patch)]


@contextlib.contextmanager
def scoped(patches: list[Patch]) -> Iterator[list[str]]:
    """Install ``patches`` for the body only; those that were already installed stay installed."""
    installed = [patch.name for patch in patches if _install(patch)]
    try:
        yield installed
    finally:
        for name in reversed(installed):
            _uninstall(name)


def revert() -> None:
    """Restore every patched callable and module-level torch (newest first)."""
    while _REBOUND:
        module, attribute, original = _REBOUND.pop()
        setattr(module, attribute, original)
    for module_name in list(_PROXIED):
        sys.modules[module_name].torch = _PROXIED.pop(module_name)
    for name in reversed(list(_APPLIED)):
        owner, attribute, original = _APPLIED.pop(name)
        setattr(owner, attribute, original)


def applied() -> list[str]:
    """Names of the patches currently installed."""
    return list(_APPLIED)
