"""megatron-core's ``jit_fuser`` compiling on first call, so that importing megatron-core does not
import ``torch._dynamo`` (the one megatron-core adjustment that must precede megatron's import, hence
not in ``mcore_patches``, whose patches wrap callables of modules already imported).

megatron-core 0.16.1 binds ``megatron.core.jit.jit_fuser = torch.compile`` and decorates a few dozen
fused functions with it at import time (``fusions/fused_bias_geglu.py`` is imported by
``transformer_config``, so by ``import megatron.core``). ``torch.compile(fn)`` compiles nothing until
``fn`` is called, but it imports ``torch._dynamo`` and ``torch._inductor`` at once: ~1.5 CPU-s in
every process that imports megatron-core, whether or not it ever calls a fused function (a CPU run
never does: they sit behind ``bias_*_fusion`` options). ``lazy_compile`` is ``torch.compile`` with
the call deferred to the function's first call: the same ``torch.compile(fn, **options)`` then runs
and every later call goes through its result, so compiled code, guards and recompiles are torch's.

``install()`` (run by ``import loongforge``, before any loongforge module imports megatron-core)
adds an import hook that swaps ``jit_fuser`` the moment ``megatron.core.jit`` has executed, before
the first ``@jit_fuser`` runs. This module imports no torch: ``import loongforge`` stays light.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable, Optional

__all__ = ["lazy_compile", "install", "uninstall", "installed"]

JIT_MODULE = "megatron.core.jit"


def lazy_compile(model: Optional[Callable] = None, **options: Any) -> Callable:
    """``torch.compile(model, **options)``, made on ``model``'s first call instead of now.

    Same forms as ``torch.compile``: ``@lazy_compile``, ``@lazy_compile(**options)``,
    ``lazy_compile(fn, **options)``. A module (not a plain function) is compiled at once: its
    ``OptimizedModule`` is an object of its own, not a function a wrapper could stand for.
    """
    if model is None:
        return functools.partial(lazy_compile, **options)
    torch = sys.modules["torch"]  # imported already: megatron.core.jit (the only user) imports it
    if isinstance(model, torch.nn.Module):
        return torch.compile(model, **options)
    compiled: list[Callable] = []

    @functools.wraps(model)
    def compile_on_first_call(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            compiled.append(torch.compile(model, **options))
        return compiled[0](*args, **kwargs)

    # What torch.compile's wrapper carries: dynamo, tracing a compiled region that calls this
    # function, inlines ``model`` instead of tracing the wrapper (torch/_dynamo/eval_frame.py).
    compile_on_first_call._torchdynamo_inline = model
    compile_on_first_call._torchdynamo_orig_callable = model
    return compile_on_first_call


def _defer_compile(jit_module: Any) -> None:
    """``jit_fuser`` -> ``lazy_compile`` when megatron chose ``torch.compile`` (not on torch < 2.2,
    where it is ``torch.jit.script``, nor after ``disable_jit_fuser()``)."""
    if jit_module.jit_fuser is sys.modules["torch"].compile:
        jit_module.jit_fuser = lazy_compile


class _DeferringLoader(importlib.abc.Loader):
    """Runs ``megatron.core.jit`` with its own loader, then defers its ``jit_fuser``."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _defer_compile(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the real loader's
        return getattr(self._loader, name)


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the path finders do and hands it the deferring loader; finds
    nothing else."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferringLoader(spec.loader)
        return spec


_FINDER = _JitFinder()


def install() -> None:
    """Defer megatron-core's ``torch.compile`` from here on. Idempotent. When megatron-core is
    imported already, its functions decorated so far stay as they are; later ones are deferred."""
    if JIT_MODULE in sys.modules:
        _defer_compile(sys.modules[JIT_MODULE])
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Remove the import hook (tests); a ``jit_fuser`` deferred already stays deferred."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def installed() -> bool:
    return _FINDER in sys.meta_path
