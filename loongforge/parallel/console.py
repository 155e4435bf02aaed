"""What a loongforge process prints besides loongforge's own lines (every command, every rank it
starts): known harmless third-party warnings are filtered.

Each of these is expected in a supported setup and says nothing the run can act on: megatron-core
announcing the torch fallbacks it uses when Transformer Engine or Apex are absent, on a CPU run
(loongforge picks its layers itself and prints them at start; on CUDA they mean a broken GPU
install and show), megatron's deprecation of a default it sets itself, the optimizer's probe of
`.grad` on its main parameters, torch's deprecation of collectives where megatron calls them (a
call of ours shows) and of the checkpoint calls megatron makes. With ``logging.verbose=true``
(``train --verbose``) they are shown, once each. Warnings of our own and every other third-party
warning always pass.

Every loongforge process installs them before it imports megatron-core: the command's own (the CLI's
app callback), the workers of a launch (``train.launch``: its fork server's preload and each
worker), and the fresh processes a command spawns (``quiet_process``: the ranks of ``convert
--check-logits --tp N``, ``encode --nproc-per-node N``, the benchmarks' measuring processes), whose
target's module would otherwise warn while a spawned child imports it, before any call of ours. A
forked process (``pack``'s workers) inherits its parent's.
"""

from __future__ import annotations

import importlib
import pickle
import re
import sys
import warnings
from typing import Callable

# (message start, the warning's category, the module that issues it), regexes as the warnings
# module matches them: the message from its start, the module in full.
KNOWN_HARMLESS: tuple[tuple[str, type[Warning], str], ...] = (
    # megatron-core 0.16's TransformerConfig defaults cuda_graph_scope to "full", then warns that "full"
    # is deprecated as it turns it into the equivalent empty list: once per config built, on every rank.
    (r"full scope is deprecated\. Use empty cuda_graph_scope", UserWarning, r"megatron\..*"),
    # megatron-core 0.16's optimizer probes `.grad` of its fp32 main parameters, views that are not
    # autograd leaves; the gradients it uses are in `main_grad`.
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
     r"megatron\.core\.optimizer\..*"),
    # Loading a checkpoint (--resume, checkpoint.load=): megatron-core 0.16's torch_dist strategy
    # calls torch.distributed.checkpoint's deprecated load_state_dict and hands it ShardedTensors,
    # which torch 2.13's planner reports twice.
    (r"`load_state_dict` is deprecated and will be removed", FutureWarning,
     r"megatron\.core\.dist_checkpointing\..*"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     r"torch\.distributed\.checkpoint\..*"),
)
# megatron-core's notices of the torch fallbacks it takes without Transformer Engine or Apex: what a
# CPU run expects, so hidden there; on a CUDA run they mean a broken GPU install, so they show.
CPU_RUN_NOTICES: tuple[tuple[str, type[Warning], str], ...] = (
    (r"Transformer Engine and Apex are not installed\. Falling back to", UserWarning, r"megatron\..*"),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\..*"),
)
# torch 2.13 renamed the tensor collectives (all_gather_into_tensor, reduce_scatter_tensor);
# megatron-core 0.16 calls the old names. torch reports them from its own c10d wrapper, so every
# caller looks alike to a module filter: hidden only where the caller is megatron-core (a call of
# ours is a defect to fix, and shows).
MEGATRONS_DEPRECATED_CALLS = re.compile(r"`torch\.distributed\.\w+` is deprecated")
# Frames between the deprecated call and the warning being shown: torch's wrappers, the
# deprecation decorator, the warnings module, this module.
_PASS_THROUGH = re.compile(r"^(torch(\..*)?|typing_extensions|warnings|" + re.escape(__name__) + r")$")


def filter_known_warnings(verbose: bool, on_cuda: bool = False) -> None:
    """Install the filters in this process (before megatron-core is imported: some warn at import).
    ``on_cuda``: the run computes on CUDA (megatron's fallback notices then show)."""
    action = "once" if verbose else "ignore"
    for message, category, module in KNOWN_HARMLESS + (() if on_cuda else CPU_RUN_NOTICES):
        warnings.filterwarnings(action, message=message, category=category, module=module)
    if verbose:
        warnings.filterwarnings("once", message=MEGATRONS_DEPRECATED_CALLS.pattern, category=FutureWarning)
    else:
        _hide_megatrons_deprecated_calls()


def _hide_megatrons_deprecated_calls() -> None:
    """Show torch's collective deprecations except where megatron-core made the call."""
    warnings.filterwarnings("always", message=MEGATRONS_DEPRECATED_CALLS.pattern, category=FutureWarning)
    shown = warnings.showwarning
    if getattr(shown, "hides_megatrons_deprecated_calls", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not (issubclass(category, FutureWarning) and MEGATRONS_DEPRECATED_CALLS.match(str(message))
                and _caller_module().startswith("megatron.")):
            shown(message, category, filename, lineno, file, line)

    showwarning.hides_megatrons_deprecated_calls = True
    warnings.showwarning = showwarning


def _caller_module() -> str:
    """The module of the first frame up the stack that is not torch, the deprecation machinery or
    the warnings module: whoever called the deprecated function."""
    frame = sys._getframe(1)
    while frame is not None and _PASS_THROUGH.match(frame.f_globals.get("__name__", "")):
        frame = frame.f_back
    return "" if frame is None else frame.f_globals.get("__name__", "")


def quiet_process(context, target: Callable, arguments: tuple, *, inherited: tuple = (), on_cuda: bool = False,
                  daemon: bool | None = None):
    """A process of ``context`` (multiprocessing's spawn context) that installs the filters, then
    imports ``target``'s module and runs ``target(*inherited, *arguments)`` (a module-level function).

    The target travels by name and ``arguments`` as bytes: unpickled as the process starts, they would
    import their modules (megatron-core's among them) before the filters are in place. ``inherited``:
    what only a process start may hand over (a queue, a manager's proxy), passed as it is. ``on_cuda``:
    the process computes on CUDA (megatron's fallback notices then show).
    """
    name = f"{target.__module__}:{target.__qualname__}"
    return context.Process(target=_run_quietly, args=(name, on_cuda, inherited, pickle.dumps(arguments)),
                           daemon=daemon)


def _run_quietly(target_name: str, on_cuda: bool, inherited: tuple, arguments: bytes) -> None:
    filter_known_warnings(verbose=False, on_cuda=on_cuda)
    module_name, _, function_name = target_name.partition(":")
    getattr(importlib.import_module(module_name), function_name)(*inherited, *pickle.loads(arguments))
