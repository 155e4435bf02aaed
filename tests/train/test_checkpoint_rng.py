"""A checkpoint's per-rank RNG state: on CUDA it keeps megatron's named RNG streams (dropout inside
tensor-parallel regions draws from them), so a resumed run draws the masks the uninterrupted one
would have."""

from __future__ import annotations

import io

import torch
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

from loongforge.train import checkpoint

STREAMS = {"model-parallel-rng": torch.arange(16, dtype=torch.uint8),
           "expert-parallel-rng": torch.arange(16, 32, dtype=torch.uint8)}


def _through_a_file(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_cuda_runs_rng_state_restores_megatrons_named_streams(monkeypatch):
    # No GPU here: CUDA's default generator is stubbed; megatron's tracker is its real class.
    tracker = CudaRNGStatesTracker()
    monkeypatch.setattr(checkpoint, "_cuda_tracker", lambda: tracker)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: None)
    tracker.set_states({name: state.clone() for name, state in STREAMS.items()})
    saved = _through_a_file(checkpoint._rng_state(on_cuda=True))
    tracker.set_states({name: torch.full((16,), 255, dtype=torch.uint8) for name in STREAMS})  # dropout drew on
    checkpoint._set_rng_state(saved, on_cuda=True)
    restored = tracker.get_states()
    assert set(restored) == set(STREAMS)
    for name, state in STREAMS.items():
        assert torch.equal(restored[name], state), name


def test_a_cpu_runs_rng_state_asks_nothing_of_cuda(monkeypatch):
    def no_cuda(*args):
        raise AssertionError("a CPU run touched CUDA's RNG")

    monkeypatch.setattr(checkpoint, "_cuda_tracker", no_cuda)
    monkeypatch.setattr(torch.cuda, "get_rng_state", no_cuda)
    state = checkpoint._rng_state(on_cuda=False)
    assert set(state) == {"python", "numpy", "torch"}
    checkpoint._set_rng_state(state, on_cuda=False)
