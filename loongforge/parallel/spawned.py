"""Waiting on a job's own worker processes (``convert --check-logits`` at TP > 1, ``encode`` on several
processes): every one runs to its end, or the first that fails stops the rest and is one error naming it."""

from __future__ import annotations

import time
from typing import Callable


def run_to_the_end(processes: list, *, what: str, poll_s: float = 0.2,
                   on_tick: Callable[[], None] = lambda: None) -> None:
    """Start ``processes`` and wait for them all, calling ``on_tick`` every ``poll_s`` seconds (a progress
    bar). A process that exits non-zero is a RuntimeError "``what`` N failed with exit code C" (its traceback
    is on the console already); the others are terminated. Always joins every process."""
    for process in processes:
        process.start()
    try:
        while any(process.is_alive() for process in processes):
            time.sleep(poll_s)
            on_tick()
            _raise_on_failure(processes, what)
        _raise_on_failure(processes, what)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()


def _raise_on_failure(processes: list, what: str) -> None:
    failed = [index for index, process in enumerate(processes) if process.exitcode not in (None, 0)]
    if failed:
        raise RuntimeError(f"{what} {failed[0]} failed with exit code {processes[failed[0]].exitcode}; "
                           "its traceback is above")
