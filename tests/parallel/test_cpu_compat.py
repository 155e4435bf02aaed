"""cpu_compat: idempotent, reversible, scoped, and what it patches works on CPU."""

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding, RotaryEmbedding

from loongforge.parallel import cpu_compat


@pytest.fixture
def patched():
    cpu_compat.revert()
    yield cpu_compat.apply(force=True)
    cpu_compat.revert()


def test_apply_is_idempotent_and_revertible(patched):
    assert patched == [p.name for p in cpu_compat.PATCHES]
    original_init = cpu_compat._APPLIED["mrope_inv_freq"][2]
    assert cpu_compat.apply(force=True) == []  # second call installs nothing
    cpu_compat.revert()
    assert cpu_compat.applied() == []
    assert MultimodalRotaryEmbedding.__init__ is original_init


def test_every_patch_says_why():
    for patch in cpu_compat.PATCHES:
        assert patch.why and hasattr(patch.owner(), patch.attribute), patch.name


def test_noop_when_cuda_is_available(monkeypatch):
    cpu_compat.revert()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply() == [] and cpu_compat.applied() == []


def test_scope_restores_torch_attributes():
    before = (torch.cuda.current_device, torch.Tensor.cuda, torch.cuda.synchronize)
    with cpu_compat.cpu_device_scope():
        assert torch.cuda.current_device() == torch.device("cpu")
        x = torch.ones(2)
        assert x.cuda() is x
    assert (torch.cuda.current_device, torch.Tensor.cuda, torch.cuda.synchronize) == before


def test_rope_and_mrope_run_on_cpu(patched):
    mrope = MultimodalRotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=10000)
    position_ids = torch.arange(5).view(1, 1, 5).expand(3, 1, 5)
    emb = mrope(position_ids, mrope_section=[4, 6, 6], cp_group=None)
    assert emb.shape == (5, 1, 1, 32) and emb.device.type == "cpu"
    # Every section sees the same (text) positions, so M-RoPE equals 1-D RoPE.
    rope = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    assert torch.allclose(rope.get_emb(5), emb)


def test_training_modules_allocate_on_cpu_and_accept_cpu_float_params(patched):
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules

    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert clip_grads.torch.tensor([1.0], device="cuda:0").device.type == "cpu"
    assert schedules.torch.cuda.current_device() == torch.device("cpu")
    # clip_grads is imported by name into optimizer.py: both references must be the patched one.
    assert optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(param.grad, torch.full((3,), 0.5), atol=1e-5)


def test_revert_restores_module_torch(patched):
    from megatron.core.pipeline_parallel import schedules

    cpu_compat.revert()
    assert schedules.torch is torch
