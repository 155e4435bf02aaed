"""ManualGC and GradSyncClock: the per-step helpers of the training loop."""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace

import torch

from loongforge.profile.timers import GradSyncClock
from loongforge.train.step import ManualGC


def test_manual_gc_collects_only_on_its_steps_and_restores_automatic_collection():
    collections = []

    def on_gc(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    assert gc.isenabled()
    gc.callbacks.append(on_gc)
    try:
        manual = ManualGC(3)
        assert not gc.isenabled()
        collections.clear()
        for step in (1, 2):
            manual.after_step(step)
        assert collections == []
        manual.after_step(3)
        assert collections == [2]  # one full collection
        manual.close()
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()


def test_manual_gc_interval_zero_leaves_python_alone():
    manual = ManualGC(0)
    assert gc.isenabled()
    manual.after_step(10)
    manual.close()
    assert gc.isenabled()


def test_grad_sync_clock_times_the_wrapped_finalize_and_resets():
    calls = []

    def finalize(*args, **kwargs):
        calls.append((args, kwargs))
        time.sleep(0.02)

    config = SimpleNamespace(finalize_model_grads_func=finalize)
    clock = GradSyncClock(config, torch.device("cpu"))
    config.finalize_model_grads_func([1], num_tokens=None)
    assert calls == [(([1],), {"num_tokens": None})]
    assert 0.015 < clock.take() < 1.0
    assert clock.take() == 0.0
