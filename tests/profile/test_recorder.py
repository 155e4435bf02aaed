"""Pairing megatron's forward/backward timer intervals with micro-batches, without a model."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from loongforge.calibrate.sweep import SweepSource
from loongforge.config.loader import load_run_config
from loongforge.profile.recorder import StepRecorder
from loongforge.profile.timers import GradSyncClock

LAYOUT = SimpleNamespace(dp_rank=0, tp_rank=0, pp_rank=0)
GRAD_SYNC_S = 1.5  # how long the stand-in gradient sync takes


class _WallClock:
    """``time.perf_counter`` that moves only when the test says: the intervals are exact whatever else
    the machine runs (a sleep may end late on a busy machine)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


WALL = _WallClock()


def _setup(steps_warmup=1):
    cfg = load_run_config("qwen2.5vl-tiny", overrides=["data.seq_len=256"])
    grad_syncs = []
    config = SimpleNamespace(timers=None, finalize_model_grads_func=lambda *a, **k: (
        grad_syncs.append(1), WALL.advance(GRAD_SYNC_S)))
    recorder = StepRecorder(model_cfg=cfg.model, rank=3, layout=LAYOUT, warmup_steps=steps_warmup)
    recorder.attach(config, torch.device("cpu"), GradSyncClock(config, torch.device("cpu")))
    return cfg, config, recorder, grad_syncs


def _forward(config, it, seconds):
    config.timers("forward-compute", log_level=2).start()
    next(it)
    WALL.advance(seconds)
    config.timers("forward-compute").stop()


def _backward(config, seconds):
    config.timers("backward-compute", log_level=2).start()
    WALL.advance(seconds)
    config.timers("backward-compute").stop()


def test_one_f_one_b_order_pairs_each_interval_with_its_micro_batch(monkeypatch):
    monkeypatch.setattr(time, "perf_counter", WALL)
    cfg, config, recorder, grad_syncs = _setup()
    source = SweepSource(cfg, dp_rank=0, dp_size=1, pad_to_multiple=8)
    forward = [1.0, 3.0, 5.0]
    backward = [6.0, 2.0, 4.0]
    records = []
    for step in (1, 2):
        batches = recorder.begin_step(step, source.next_step()[:3])
        assert config.timers is not None
        config.timers("forward-backward", log_level=1).start(barrier=False)
        it = iter(batches)
        # Pipeline-like order: two forwards in flight before the first backward.
        _forward(config, it, forward[0])
        _forward(config, it, forward[1])
        _backward(config, backward[0])
        _forward(config, it, forward[2])
        _backward(config, backward[1])
        _backward(config, backward[2])
        config.finalize_model_grads_func()
        config.timers("forward-backward").stop()
        records += recorder.end_step(step, SimpleNamespace(compute_s=0.3))
        assert config.timers is None
    mbs = [r for r in records if r["kind"] == "micro_batch"]
    steps = [r for r in records if r["kind"] == "step"]
    assert [(r["step"], r["micro_batch"]) for r in mbs] == [(s, i) for s in (1, 2) for i in range(3)]
    assert [r["warmup"] for r in steps] == [True, False]
    for r in mbs:
        i = r["micro_batch"]
        for measured, expected in ((r["forward_s"], forward[i]), (r["backward_s"], backward[i])):
            assert measured == expected, (i, measured, expected)
        assert 0 <= r["forward_cpu_s"] < r["forward_s"]  # the clock's seconds cost no CPU
        assert r["rank"] == 3 and r["features"]["N"] == len(r["samples"])
    for r in steps:
        assert r["fwd_bwd_s"] >= sum(forward) + sum(backward) and r["step_s"] >= r["fwd_bwd_s"]
        assert r["grad_sync_s"] == GRAD_SYNC_S, r["grad_sync_s"]
        assert r["num_micro_batches"] == 3
    assert len(grad_syncs) == 2
