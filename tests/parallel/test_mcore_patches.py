"""mcore_patches: idempotent, reversible, scoped, applied by the run's device, and what it patches works."""

import psutil
import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding,
    RotaryEmbedding,
)

from loongforge.parallel import mcore_patches
from tests.models.helpers import destroy_megatron, free_port, init_megatron


@pytest.fixture
def patched():
    mcore_patches.revert()
    yield mcore_patches.apply_cpu()
    mcore_patches.revert()


def test_apply_is_idempotent_and_revertible(patched):
    assert patched == [p.name for p in mcore_patches.CPU_PATCHES]
    original_init = mcore_patches._APPLIED["mrope_inv_freq"][2]
    assert mcore_patches.apply_cpu() == []  # second call installs nothing
    mcore_patches.revert()
    assert mcore_patches.applied() == []
    assert MultimodalRotaryEmbedding.__init__ is original_init


def test_every_patch_says_why():
    for patch in (mcore_patches.CPU_PATCHES + mcore_patches.CHECKPOINT_LOAD_PATCHES
                  + mcore_patches.CHECKPOINT_SAVE_PATCHES):
        assert patch.why and hasattr(patch.owner(), patch.attribute), patch.name


def test_cpu_patches_install_whether_or_not_cuda_is_visible(monkeypatch):
    """The caller decides by the run's device; a visible GPU does not turn the patches off."""
    mcore_patches.revert()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        assert mcore_patches.apply_cpu() == [p.name for p in mcore_patches.CPU_PATCHES]
    finally:
        mcore_patches.revert()


def test_scoped_patches_are_gone_after_the_body_even_on_error():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    with pytest.raises(RuntimeError, match="inside"):
        with mcore_patches.scoped(mcore_patches.CHECKPOINT_LOAD_PATCHES) as installed:
            assert installed == ["distributed_optimizer_state_restore"]
            assert DistributedOptimizer._set_main_param_and_optimizer_states is not original
            raise RuntimeError("inside")
    assert DistributedOptimizer._set_main_param_and_optimizer_states is original
    assert "distributed_optimizer_state_restore" not in mcore_patches.applied()


def test_scoped_leaves_an_already_installed_patch_installed(patched):
    with mcore_patches.scoped(mcore_patches.CPU_PATCHES[:1]) as installed:
        assert installed == []
    assert mcore_patches.CPU_PATCHES[0].name in mcore_patches.applied()


class _FakeDistributedOptimizer:
    """What the restore patch reads of a DistributedOptimizer: config, index map, inner optimizer."""

    def __init__(self, inner: torch.optim.Optimizer, model_param: torch.nn.Parameter):
        self.config = type("Config", (), {"use_precision_aware_optimizer_no_fp8_or_ds_fp8": False})()
        self.optimizer = inner
        self.model_param_group_index_map = {model_param: (0, 0)}


def _restore():
    patch = mcore_patches.CHECKPOINT_LOAD_PATCHES[0]
    return patch.wrap(lambda *args: pytest.fail("original must not run"))


def test_restore_copies_into_grad_requiring_params_and_ignores_adams_step():
    main = torch.nn.Parameter(torch.zeros(3))
    adam = torch.optim.Adam([main])
    adam.state[main] = {"step": torch.tensor(7.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    saved = {"param": torch.full((3,), 1.0), "exp_avg": torch.full((3,), 2.0), "exp_avg_sq": torch.full((3,), 3.0)}
    _restore()(_FakeDistributedOptimizer(adam, main), main, saved)
    assert torch.equal(main.detach(), saved["param"])
    assert torch.equal(adam.state[main]["exp_avg_sq"], saved["exp_avg_sq"])
    assert float(adam.state[main]["step"]) == 7.0


def test_restore_raises_on_a_real_state_mismatch():
    main = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([main], lr=0.1, momentum=0.9)
    sgd.state[main] = {"momentum_buffer": torch.zeros(3)}
    saved = {"param": torch.ones(3), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}
    with pytest.raises(RuntimeError, match=r"checkpoint holds \['exp_avg', 'exp_avg_sq', 'param'\].*SGD"):
        _restore()(_FakeDistributedOptimizer(sgd, main), main, saved)


def test_scope_restores_torch_attributes():
    before = (torch.cuda.current_device, torch.Tensor.cuda, torch.cuda.synchronize)
    with mcore_patches.cpu_device_scope():
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

    mcore_patches.revert()
    assert schedules.torch is torch


def test_checkpoint_save_starts_no_process_and_round_trips(patched, tmp_path, monkeypatch):
    """Saving under CHECKPOINT_SAVE_PATCHES writes every file from threads: no Manager, no forked
    writer, and the checkpoint reads back identical."""
    # Unpatched, megatron would create (and keep) its Manager here: make sure one is not cached.
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    tensors = {f"t{i}": torch.arange(1000 * (i + 1), dtype=torch.float32) for i in range(6)}

    def sharded(source: dict) -> dict:
        return {key: ShardedTensor.from_rank_offsets(key, value) for key, value in source.items()}

    init_megatron(rank=0, world_size=1, port=free_port())
    try:
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        with mcore_patches.scoped(mcore_patches.CHECKPOINT_SAVE_PATCHES):
            dist_checkpointing.save(sharded(tensors), str(tmp_path))
        after = {child.pid for child in psutil.Process().children(recursive=True)}
        loaded = dist_checkpointing.load(sharded({k: torch.zeros_like(v) for k, v in tensors.items()}),
                                         str(tmp_path))
    finally:
        destroy_megatron()
    assert after <= before and filesystem_async._results_queue is None
    assert len(list(tmp_path.glob("*.distcp"))) == 2  # both writer threads wrote a file
    for key, value in tensors.items():
        assert torch.equal(loaded[key], value), key


def test_grad_norm_is_float64_accurate_whatever_the_sharding(patched):
    """megatron's grad norm on the CPU (clip_grads.l2_norm_impl) gives the same value for one
    long gradient and for its TP shards; the float32 fallback it replaces was off by ~1e-5 on the
    tiny preset's 19M-element embedding gradient, by an amount that depends on the shard size."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    grad = torch.randn(8_000_000, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = grad.double().norm().item()

    def norm(tensors: list[torch.Tensor]) -> float:
        value, per_tensor = clip_grads.multi_tensor_applier(
            clip_grads.l2_norm_impl, torch.zeros(1, dtype=torch.int), [tensors], False)
        assert per_tensor is None and value.shape == (1,)
        return value.item()

    whole, four_shards = norm([grad]), (sum(norm([s]) ** 2 for s in grad.chunk(4))) ** 0.5
    assert abs(whole - exact) <= 1e-12 * exact and abs(four_shards - exact) <= 1e-12 * exact
    # What the patch is for: the fallback's float32 norm misses by far more than fp32 rounding.
    fallback, _ = local_multi_tensor_l2_norm(0, None, [[grad]], False)
    assert abs(fallback.item() - exact) > 1e-6 * exact


def test_moe_router_linear_runs_without_transformer_engine(patched):
    """Unpatched, megatron-core 0.16.1's router linear raises NameError without TE; patched, it is
    input @ weight.T in the router dtype, with gradients, and router.py calls the patched one."""
    from megatron.core.transformer.moe import moe_utils, router

    assert "te_general_gemm" not in vars(moe_utils)  # this machine has no Transformer Engine
    original = mcore_patches._APPLIED["moe_router_gating_linear"][2]
    inputs = torch.randn(5, 2, 8, requires_grad=True)
    weight = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(NameError, match="te_general_gemm"):
        original(inputs, weight, None, torch.float32)
    assert router.router_gating_linear is moe_utils.router_gating_linear is not original
    logits = router.router_gating_linear(inputs, weight, None, torch.float64)
    assert logits.dtype == torch.float64 and logits.shape == (5, 2, 4)
    assert torch.allclose(logits, inputs.double() @ weight.double().T)
    logits.sum().backward()
    assert inputs.grad is not None and weight.grad is not None


def test_without_te_installs_only_the_te_stand_ins():
    without_te = ["moe_router_gating_linear", "mla_te_linear_stand_in"]
    mcore_patches.revert()
    try:
        assert mcore_patches.apply_without_te() == without_te
        assert mcore_patches.applied() == without_te
    finally:
        mcore_patches.revert()


def test_multi_latent_attention_checks_its_output_linear_without_te():
    """megatron's MLA asks isinstance(linear_proj, TELinear); without TE its TELinear is a MagicMock."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer import multi_latent_attention

    mcore_patches.revert()
    try:
        with pytest.raises(TypeError, match="isinstance"):
            isinstance(object(), multi_latent_attention.TELinear)
        mcore_patches.apply_without_te()
        assert not isinstance(object.__new__(RowParallelLinear), multi_latent_attention.TELinear)
    finally:
        mcore_patches.revert()
