"""IntervalTimers: the CPU path (wall clock + CPU clock) and the CUDA-event path's logic, the latter
with a stand-in for torch.cuda.Event so it runs on CPU."""

from __future__ import annotations

import time

import pytest
import torch

from loongforge.profile import timers as timers_module
from loongforge.profile.timers import IntervalTimers


def _no_device_sync(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("device"))
    return calls


def test_cpu_intervals_are_wall_and_cpu_clock_and_never_touch_cuda(monkeypatch):
    device_syncs = _no_device_sync(monkeypatch)
    seen = []
    timers = IntervalTimers(torch.device("cpu"), on_stop=lambda *args: seen.append(args))
    timer = timers("forward-compute", log_level=2)
    assert type(timer).__name__ == "_Timer" and timers("forward-compute") is timer
    timer.start()
    time.sleep(0.05)  # wall time, almost no CPU time
    timer.stop()
    timer.stop()  # a stop without a start is ignored
    timers.sync()
    (name, seconds, cpu_seconds), = seen
    assert name == "forward-compute" and 0.045 <= seconds < 1.0 and cpu_seconds < 0.04
    assert device_syncs == []


class _FakeEvent:
    """torch.cuda.Event stand-in: record() stamps a fake device clock, elapsed_time() in ms."""

    clock_ms = 0.0
    log: list = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.stamp = None

    def record(self, stream=None):
        self.stamp = _FakeEvent.clock_ms
        _FakeEvent.log.append("record")

    def synchronize(self):
        _FakeEvent.log.append("event-sync")

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return end.stamp - self.stamp


@pytest.fixture
def fake_cuda(monkeypatch):
    _FakeEvent.clock_ms, _FakeEvent.log = 0.0, []
    monkeypatch.setattr(timers_module.torch.cuda, "Event", _FakeEvent)
    return _no_device_sync(monkeypatch)


def test_cuda_intervals_are_event_pairs_resolved_at_stop_without_device_syncs(fake_cuda):
    seen = []
    timers = IntervalTimers(torch.device("cuda"), on_stop=lambda *args: seen.append(args))
    forward, backward = timers("forward-compute"), timers("backward-compute")
    forward.start()
    _FakeEvent.clock_ms = 12.5  # the device ran 12.5 ms of queued work
    assert _FakeEvent.log == ["record"] and seen == []  # starting waits for nothing
    forward.stop()
    assert _FakeEvent.log == ["record", "record", "event-sync"]  # waits for its own end event only
    backward.start()
    _FakeEvent.clock_ms = 40.0
    backward.stop()
    assert [(name, seconds) for name, seconds, _ in seen] == [("forward-compute", 0.0125),
                                                              ("backward-compute", 0.0275)]
    assert fake_cuda == []  # no device-wide synchronize per interval
    timers.sync()  # step boundaries still drain the device
    assert fake_cuda == ["device"]


def test_cuda_stop_without_start_is_ignored(fake_cuda):
    seen = []
    IntervalTimers(torch.device("cuda"), on_stop=lambda *args: seen.append(args))("x").stop()
    assert seen == [] and _FakeEvent.log == []
