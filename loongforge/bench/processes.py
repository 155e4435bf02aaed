"""Measuring processes of the benchmarks: started fresh (``spawn``), so each holds only what its
measurement needs (its own peak RSS, its own CUDA context), and watched while the parent waits, so
a process that dies is one error naming its exit code instead of a wait on a queue that never fills.
Each installs the console's filters before it imports its target's module (``console.quiet_process``:
the module may import megatron-core, whose import warns), so its stderr is as quiet as the command's."""

from __future__ import annotations

import multiprocessing
import queue as queue_module
from typing import Callable

from loongforge.parallel.console import quiet_process

_POLL_S = 2.0


def run_spawned(target: Callable, argument_lists: list[tuple], *, what: str, on_cuda: bool = False,
                start_method: str = "spawn") -> list:
    """One fresh process per argument tuple, started together, each running ``target(queue,
    *arguments)`` (a module-level function) and putting exactly one result on the queue; the results
    in the order they came. A process that exits without its result (a crash, a failed collective)
    is a RuntimeError naming ``what`` and its exit code; the others are stopped. ``on_cuda``: the
    processes compute on CUDA (the console then shows megatron's fallback notices). ``start_method``:
    a test's hook ("forkserver": forked from this process's preloaded fork server, ``parallel.fork_server``,
    so a test pays no interpreter start per process; their memory figures are then not their own)."""
    context = multiprocessing.get_context(start_method)
    results_queue = context.Queue()
    processes = [quiet_process(context, target, arguments, inherited=(results_queue,), on_cuda=on_cuda)
                 for arguments in argument_lists]
    for process in processes:
        process.start()
    try:
        results = [_next_result(results_queue, processes, what) for _ in processes]
    except BaseException:
        for process in processes:
            process.kill()
        raise
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"{what}: a measuring process exited with {process.exitcode}")
    return results


def _next_result(results_queue, processes: list, what: str):
    while True:
        try:
            return results_queue.get(timeout=_POLL_S)
        except queue_module.Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"{what}: a measuring process exited with {failed[0]} before its result "
                                   f"(its error is printed above)") from None
