"""The encoder clock on a stand-in encoder (two linear towers): forward and backward are timed on a
rank that encodes, nothing is counted on one that does not, and pipelined orders pair up."""

from __future__ import annotations

import time

import pytest
import torch

from loongforge.parallel.encoder_dp import touch_with_zero
from loongforge.profile.encoder_clock import EncoderClock
from loongforge.profile.memory import peak_memory_mib

WIDTH = 256


class _SlowLinear(torch.nn.Linear):
    """A linear whose backward also sleeps, so that backward time is certainly > 0 on the wall clock."""

    def forward(self, x):
        out = super().forward(x)
        if out.requires_grad:
            out.register_hook(lambda grad: time.sleep(0.01))
        return out


def _encoder():
    torch.manual_seed(0)
    tower, projector = _SlowLinear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 8)
    return tower, projector, EncoderClock([tower, projector], torch.device("cpu"))


def _encode(tower, projector, rows: int = 512) -> torch.Tensor:
    return projector(tower(torch.randn(rows, WIDTH)))


def test_a_rank_that_encodes_counts_forward_and_backward():
    tower, projector, clock = _encoder()
    text = torch.randn(4, 8, requires_grad=True)
    loss = (_encode(tower, projector).sum() + text.sum())
    loss.backward()
    took = clock.take()
    assert took.forwards == 1
    assert took.forward_s > 0 and took.backward_s >= 0.01
    assert took.forward_cpu_s > 0 and took.backward_cpu_s > 0
    assert took.total_s == pytest.approx(took.forward_s + took.backward_s)
    assert clock.take().total_s == 0.0  # take resets


def test_a_rank_that_encodes_nothing_counts_nothing():
    """No media here: the towers are not called, yet backward still gives their parameters a zero
    gradient (as the model does for megatron's buckets): no interval opens."""
    tower, projector, clock = _encoder()
    text = torch.randn(4, 8, requires_grad=True)
    loss = touch_with_zero(text, [*tower.parameters(), *projector.parameters()]).sum()
    loss.backward()
    assert tower.weight.grad is not None and float(tower.weight.grad.abs().sum()) == 0.0
    took = clock.take()
    assert (took.forwards, took.total_s, took.total_cpu_s) == (0, 0.0, 0.0)


def test_pipelined_order_pairs_each_backward():
    """Two forwards in flight, then their backwards, then a backward with no encoder in it."""
    tower, projector, clock = _encoder()
    first, second = _encode(tower, projector), _encode(tower, projector)
    first.sum().backward()
    second.sum().backward()
    text_only = touch_with_zero(torch.randn(3, requires_grad=True), tower.parameters())
    text_only.sum().backward()
    took = clock.take()
    assert took.forwards == 2
    assert took.backward_s >= 0.02  # both encoder backwards, each sleeping 10 ms


def test_frozen_encoder_is_timed_forward_only_and_close_removes_hooks():
    tower, projector, clock = _encoder()
    for param in [*tower.parameters(), *projector.parameters()]:
        param.requires_grad_(False)
    frozen_clock = EncoderClock([tower, projector], torch.device("cpu"))
    clock.close()
    with torch.no_grad():
        _encode(tower, projector)
    assert clock.take().forwards == 0
    took = frozen_clock.take()
    assert took.forwards == 1 and took.forward_s > 0 and took.backward_s == 0.0


def test_peak_memory_is_positive_on_cpu():
    assert peak_memory_mib(torch.device("cpu")) > 10


def test_a_backward_run_with_autograd_grad_is_timed():
    """encoder_dp=full runs the encoder's backward with torch.autograd.grad (the gradients go to
    megatron's buffers by hand): the clock times it, and does not break it."""
    tower, projector, clock = _encoder()
    features = _encode(tower, projector)
    params = [*tower.parameters(), *projector.parameters()]
    grads = torch.autograd.grad(features, params, grad_outputs=torch.ones_like(features))
    assert all(g is not None for g in grads) and tower.weight.grad is None
    took = clock.take()
    assert took.forwards == 1 and took.backward_s >= 0.01
