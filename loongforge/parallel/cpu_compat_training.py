"""Training-side CPU compatibility for megatron-core 0.16.1 (DDP, optimizer, schedules, p2p, checkpoints).

megatron-core assumes CUDA in a known list of call sites (see ``shared/docs/megatron-cpu.md``): literal
``device="cuda"``, ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``, ``Tensor.cuda()`` and
type-name checks against ``torch.cuda.FloatTensor``. When CUDA is absent we make exactly those sites see
the CPU, and nothing else:

* device requests: each listed megatron module gets a module-local ``torch`` proxy whose tensor
  factories map a CUDA device to the CPU and whose ``torch.cuda`` answers ``current_device()`` with
  ``"cpu"`` and makes ``synchronize()`` a no-op. Other modules, and user code, see the real torch.
* ``Tensor.cuda()`` and ``Tensor.type()`` checks: the few functions that use them run inside a context
  that makes ``.cuda()`` the identity and reports CPU tensors under their CUDA type names.

GPU users never reach this module: ``apply()`` returns at once when CUDA is available.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types

import torch

# megatron-core modules whose module-level ``torch`` is replaced by the CPU proxy.
_DEVICE_PROXY_MODULES = (
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.utils",  # local multi-tensor fallbacks (grad norm, scale)
)

# (module, qualified function name) that call ``Tensor.cuda()`` or compare ``Tensor.type()`` names.
_TENSOR_METHOD_SITES = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer"),
)

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "empty_like",
              "ones_like", "full_like", "randn", "rand")
_applied = False
_lock = threading.Lock()


def _cpu_device(device):
    """Map any CUDA device spec (``"cuda"``, ``"cuda:0"``, an int, a torch.device) to the CPU."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    return torch.device("cpu") if torch.device(device).type == "cuda" else device


class _CpuCudaNamespace(types.SimpleNamespace):
    """Stands in for ``torch.cuda`` inside the proxied megatron modules."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _make_cuda_namespace():
    return _CpuCudaNamespace(
        current_device=lambda: "cpu",
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        is_available=lambda: False,
        default_stream=lambda *a, **k: None,
        stream=lambda *a, **k: contextlib.nullcontext(),
    )


class _CpuTorchProxy(types.ModuleType):
    """A ``torch`` look-alike whose factories never allocate on CUDA."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _make_cuda_namespace()
        for name in _FACTORIES:
            setattr(self, name, self._wrap_factory(getattr(torch, name)))

    @staticmethod
    def _wrap_factory(factory):
        @functools.wraps(factory)
        def cpu_factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return factory(*args, **kwargs)

        return cpu_factory

    def __getattr__(self, name):
        return getattr(torch, name)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_tensor_methods_on_cpu():
    """Inside: ``t.cuda()`` returns ``t`` and ``t.type()`` reports CUDA names for CPU float tensors."""
    original_cuda, original_type = torch.Tensor.cuda, torch.Tensor.type

    def cuda_identity(self, *args, **kwargs):
        return self

    def type_as_cuda(self, *args, **kwargs):
        name = original_type(self, *args, **kwargs)
        return _CUDA_TYPE_NAMES.get(name, name) if not args and not kwargs else name

    torch.Tensor.cuda, torch.Tensor.type = cuda_identity, type_as_cuda
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.Tensor.type = original_cuda, original_type


def _wrap_in_context(owner, attr):
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        with _cuda_tensor_methods_on_cpu():
            return original(*args, **kwargs)

    setattr(owner, attr, wrapped)
    # Modules that imported the function by name hold their own reference: rebind those too.
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("megatron.core") and \
                getattr(module, attr, None) is original:
            setattr(module, attr, wrapped)


def _resolve_owner(module, qualname):
    *path, attr = qualname.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def apply_training_patches() -> bool:
    """Patch the training-side CUDA call sites; returns False (and does nothing) when CUDA exists."""
    global _applied
    if torch.cuda.is_available():
        return False
    with _lock:
        if _applied:
            return True
        proxy = _CpuTorchProxy()
        for module_name in _DEVICE_PROXY_MODULES:
            importlib.import_module(module_name).torch = proxy
        for module_name, qualname in _TENSOR_METHOD_SITES:
            owner, attr = _resolve_owner(importlib.import_module(module_name), qualname)
            _wrap_in_context(owner, attr)
        _applied = True
    return True
