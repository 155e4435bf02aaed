"""The benchmarks' measuring processes: a result per process, and a process that dies is one error
naming its exit code, not a wait on a queue that never fills (``bench data`` waited an hour)."""

from __future__ import annotations

import os

import pytest

from loongforge.bench.processes import run_spawned


def _square(results_queue, value: int) -> None:
    results_queue.put(value * value)


def _die(results_queue, code: int) -> None:
    os._exit(code)


def test_each_process_puts_its_result():
    assert sorted(run_spawned(_square, [(2,), (3,)], what="test")) == [4, 9]


def test_a_process_that_dies_before_its_result_is_one_error_naming_its_code():
    with pytest.raises(RuntimeError, match="test: a measuring process exited with 3"):
        run_spawned(_die, [(3,)], what="test")
