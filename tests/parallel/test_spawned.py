"""A job's own worker processes (``parallel.spawned``): the first that fails stops the others at once and is
one error naming it; processes that all succeed are waited for, the tick called while they run."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from loongforge.parallel.spawned import run_to_the_end


def _sleep():
    time.sleep(60)


def _exit_with(code: int):
    os._exit(code)


def test_the_first_failure_stops_the_others_and_names_the_process():
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_sleep), context.Process(target=_exit_with, args=(3,))]
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="worker 1 failed with exit code 3"):
        run_to_the_end(processes, what="worker", poll_s=0.05)
    seconds = time.perf_counter() - start
    print(f"\nstopped after {seconds:.2f} s; the sleeper's exit code {processes[0].exitcode}")
    assert seconds < 10 and processes[0].exitcode is not None and not processes[0].is_alive()


def test_processes_that_succeed_are_waited_for():
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_exit_with, args=(0,)) for _ in range(2)]
    ticks = []
    run_to_the_end(processes, what="worker", poll_s=0.05, on_tick=lambda: ticks.append(1))
    assert [process.exitcode for process in processes] == [0, 0] and ticks
