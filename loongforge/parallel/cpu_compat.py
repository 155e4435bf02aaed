"""Run megatron-core on CPU (gloo) by patching its few CUDA-only call sites.

megatron-core 0.16.1 assumes CUDA in a handful of places (see docs/megatron-cpu.md): it moves RoPE
frequencies to ``torch.cuda.current_device()``, calls ``Tensor.cuda()`` before some all-reduces, and
so on. Everything else runs fine over gloo. Rather than forking those functions, each patch below
wraps one megatron-core callable so that *while it runs* CUDA device queries resolve to the CPU
(``cpu_device_scope``). GPU users are untouched: ``apply()`` is a no-op when CUDA is available.

Add a patch by appending a ``Patch`` to ``PATCHES`` with a name, the owner (class or module), the
attribute, a one-line reason and a wrapper factory (usually ``run_in_cpu_device_scope``). ``apply()``
is idempotent; ``revert()`` restores the originals (tests use it).

The scope swaps process-global attributes of ``torch`` for the duration of the wrapped call, so it
is not thread-safe; megatron-core builds and runs models on the main thread, which is all we need.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

__all__ = ["Patch", "PATCHES", "apply", "revert", "applied", "cpu_device_scope", "run_in_cpu_device_scope"]


@contextlib.contextmanager
def cpu_device_scope() -> Iterator[None]:
    """Inside: ``torch.cuda.current_device()`` is the CPU, ``Tensor.cuda()`` keeps tensors on the CPU
    and ``torch.cuda.synchronize()`` does nothing. Re-entrant: restores whatever was there before."""
    saved = (torch.cuda.current_device, torch.Tensor.cuda, torch.cuda.synchronize)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.current_device, torch.Tensor.cuda, torch.cuda.synchronize = saved


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


# Model-side patches. Training-side ones (DDP buffers, optimizer, clip_grads, p2p, schedules) go below.
PATCHES: list[Patch] = [
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
        name="tied_embedding_sync",
        owner_path="megatron.core.models.common.language_module.language_module:LanguageModule",
        attribute="setup_embeddings_and_output_layer",
        why="weight.data.cuda() before all-reducing tied embeddings, PP > 1 (language_module.py:244)",
    ),
]

# name -> (owner, attribute, original callable)
_APPLIED: dict[str, tuple[Any, str, Callable]] = {}


def apply(force: bool = False) -> list[str]:
    """Install every patch not yet installed; returns the names installed by this call.

    A no-op when CUDA is available (unless ``force``, for tests), so GPU runs use megatron-core as is.
    """
    if torch.cuda.is_available() and not force:
        return []
    installed = []
    for patch in PATCHES:
        if patch.name in _APPLIED:
            continue
        owner = patch.owner()
        original = getattr(owner, patch.attribute)
        setattr(owner, patch.attribute, patch.wrap(original))
        _APPLIED[patch.name] = (owner, patch.attribute, original)
        installed.append(patch.name)
    return installed


def revert() -> None:
    """Restore every patched callable (newest first)."""
    for name in reversed(list(_APPLIED)):
        owner, attribute, original = _APPLIED.pop(name)
        setattr(owner, attribute, original)


def applied() -> list[str]:
    """Names of the patches currently installed."""
    return list(_APPLIED)
