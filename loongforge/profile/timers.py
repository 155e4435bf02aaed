"""Per-rank compute timing through megatron-core's own ``config.timers`` hooks.

megatron-core's schedules call ``config.timers('forward-compute').start()/.stop()`` around each
micro-batch forward and ``'backward-compute'`` around each backward (pipeline send/receive and the
gradient all-reduce happen outside those intervals), and ``'forward-backward'`` around the whole
schedule. ``IntervalTimers`` implements that interface and keeps every interval, in order, so
``train`` and ``profile`` time exactly the code path they run.

On CUDA kernels are asynchronous, so a wall clock alone would time the launches, not the work.
Each interval is therefore a pair of ``torch.cuda.Event(enable_timing=True)`` recorded on the
current stream at start and stop: the start costs no synchronisation (the queue keeps running),
and the device itself measures the work between the two. The interval is resolved when its
consumer needs the value: ``on_stop`` is called as the interval ends, because
``profile.recorder.StepRecorder`` pairs a forward with the micro-batch that is current at that
moment (the data iterator advances inside the next forward), so the stop waits for its own end
event (``Event.synchronize``: this interval's kernels, not a device-wide drain). The cost is one
wait per interval instead of the two full synchronisations (start and stop) of a wall clock.

On CPU the wall clock is the work, but on a shared machine it also counts time other processes
hold the cores; there every interval is also timed with a CPU clock, which counts only this
process's work: with one compute thread (``OMP_NUM_THREADS=1``; CPU autograd runs on the calling
thread) the calling thread's CPU time, so the data-loading thread is not counted; with more, the
whole process's (OpenMP workers included, and their spin-waiting). On CUDA the CPU clock is kept
too (the host's share: launches and Python).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch


def cpu_clock_name() -> str:
    return "thread" if torch.get_num_threads() == 1 else "process"


def cpu_clock():
    """The CPU clock for this process's compute (see the module docstring)."""
    return time.thread_time if cpu_clock_name() == "thread" else time.process_time


class _Timer:
    """Wall clock around a synchronised device: the CPU path (``sync`` is a no-op there)."""

    def __init__(self, owner: "IntervalTimers", name: str):
        self._owner, self._name = owner, name
        self._start: Optional[float] = None
        self._start_cpu = 0.0

    def start(self, barrier: bool = False) -> None:  # barrier: megatron's flag, deliberately ignored
        self._owner.sync()
        self._start = time.perf_counter()
        self._start_cpu = self._owner.cpu_clock()

    def stop(self, barrier: bool = False) -> None:
        if self._start is None:
            return
        self._owner.sync()
        self._owner.on_stop(self._name, time.perf_counter() - self._start,
                            self._owner.cpu_clock() - self._start_cpu)
        self._start = None


class _CudaEventTimer:
    """Device time between two CUDA events on the current stream (see the module docstring)."""

    def __init__(self, owner: "IntervalTimers", name: str):
        self._owner, self._name = owner, name
        self._start: Optional[torch.cuda.Event] = None
        self._start_cpu = 0.0

    def start(self, barrier: bool = False) -> None:  # barrier: megatron's flag, deliberately ignored
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()
        self._start_cpu = self._owner.cpu_clock()

    def stop(self, barrier: bool = False) -> None:
        if self._start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        cpu_seconds = self._owner.cpu_clock() - self._start_cpu
        end.synchronize()  # resolve now: the consumer reads its context at this moment
        self._owner.on_stop(self._name, self._start.elapsed_time(end) / 1000.0, cpu_seconds)
        self._start = None


class IntervalTimers:
    """Callable like megatron's ``Timers``: ``timers(name, log_level=None)`` -> a start/stop timer.

    Each finished interval is handed to ``on_stop(name, seconds, cpu_seconds)`` as it ends:
    ``seconds`` is wall-clock time on CPU and device time between CUDA events on CUDA.
    """

    def __init__(self, device: torch.device, on_stop: Callable[[str, float, float], None]):
        self._cuda = device.type == "cuda"
        self._timer_class = _CudaEventTimer if self._cuda else _Timer
        self._timers: dict = {}
        self._on_stop = on_stop
        self.cpu_clock = cpu_clock()

    def __call__(self, name: str, log_level: Optional[int] = None):
        if name not in self._timers:
            self._timers[name] = self._timer_class(self, name)
        return self._timers[name]

    def sync(self) -> None:
        """Wait for all queued device work (step boundaries, the gradient sync); no-op on CPU."""
        if self._cuda:
            torch.cuda.synchronize()

    def on_stop(self, name: str, seconds: float, cpu_seconds: float) -> None:
        self._on_stop(name, seconds, cpu_seconds)


class GradSyncClock:
    """The one timing hook on megatron's ``finalize_model_grads`` (the data-parallel gradient
    all-reduce): running totals of its wall and CPU seconds on this rank.

    A rank that finishes its micro-batches early blocks there until the slowest rank arrives, so
    the spread of these times over ranks is the step's measured load imbalance (what balancing
    removes); ``profile`` records the same interval per step. Readers take differences of the
    totals, so several can share the clock without resetting each other.
    """

    def __init__(self, model_config, device: torch.device):
        self.total_s = 0.0
        self.total_cpu_s = 0.0
        self._cuda = device.type == "cuda"
        self._cpu_clock = cpu_clock()
        self._taken = 0.0
        finalize = model_config.finalize_model_grads_func
        if finalize is None:
            return

        def timed_finalize(*args, **kwargs):
            if self._cuda:  # kernels still queued belong to the backward, not to the wait
                torch.cuda.synchronize()
            start, start_cpu = time.perf_counter(), self._cpu_clock()
            try:
                return finalize(*args, **kwargs)
            finally:
                if self._cuda:
                    torch.cuda.synchronize()
                self.total_s += time.perf_counter() - start
                self.total_cpu_s += self._cpu_clock() - start_cpu

        model_config.finalize_model_grads_func = timed_finalize

    def take(self) -> float:
        """Wall seconds spent in the gradient sync since the last ``take``."""
        seconds, self._taken = self.total_s - self._taken, self.total_s
        return seconds
