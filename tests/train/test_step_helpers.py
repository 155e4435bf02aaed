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


def test_the_step_drops_the_fp8_weight_copies_after_the_update():
    """Issue 30, 5(e): ``train_step`` calls ``weights_changed`` right after ``optimizer.step``: every
    chunk's ``Fp8WeightCache`` (inside megatron's DDP wrapper or not) forgets its copies, so the next
    step quantises the updated weights once each."""
    import inspect

    from loongforge.models.layers.fp8 import Fp8WeightCache
    from loongforge.train import step

    weight = torch.ones(16, 16)
    caches = [Fp8WeightCache(), Fp8WeightCache()]
    for cache in caches:
        cache.get(weight)
        cache.get(weight)
    assert [cache.quantisations for cache in caches] == [1, 1]
    model = [SimpleNamespace(module=SimpleNamespace(fp8_weights=caches[0])), SimpleNamespace(fp8_weights=caches[1]),
             SimpleNamespace(module=SimpleNamespace())]  # a chunk without FP8 layers
    step.weights_changed(model)
    for cache in caches:
        cache.get(weight)
    assert [cache.quantisations for cache in caches] == [2, 2]
    source = inspect.getsource(step.train_step)
    assert source.index("weights_changed(model)") == source.index("optimizer.step()") + len(
        "optimizer.step()\n    ")
