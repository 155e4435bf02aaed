"""Which optimizer a resume builds: a null ``parallel.use_distributed_optimizer`` follows the checkpoint's
kind of optimizer state (megatron-core loads each kind into its own only), a set value that differs is refused
with a remedy. The DP 2 -> 4 and CP 2 -> 1 resumes that rely on it are test_dp_resize_train.py's and
test_context_parallel_train.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongforge.config.errors import InputError
from loongforge.config.layout import data_parallel_settings
from loongforge.config.schema import ParallelConfig
from loongforge.train import checkpoint
from loongforge.train.checkpoint import check_optimizer_kind, saved_distributed_optimizer


def _checkpoint(folder: Path, meta: dict) -> Path:
    (folder / "model_optim").mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def test_the_kind_is_read_from_meta_json_or_told_by_the_saved_state(tmp_path, monkeypatch):
    recorded = _checkpoint(tmp_path / "recorded", {"step": 2, "layout": {"dp": 2, "distributed_optimizer": True}})
    assert saved_distributed_optimizer(recorded) is True
    model_only = _checkpoint(tmp_path / "model", {"kind": "model"})
    assert saved_distributed_optimizer(model_only) is None
    assert saved_distributed_optimizer(tmp_path / "missing") is None
    older = _checkpoint(tmp_path / "older", {"step": 2, "layout": {"dp": 2}})  # before meta.json said
    for keys, kind in ((["optimizer.state.param.w", "optimizer.state.exp_avg.w", "w"], True),
                       (["optimizer.state.exp_avg.w", "w"], False), (["w"], None)):
        monkeypatch.setattr(checkpoint, "_saved_keys", lambda folder, keys=keys: set(keys))
        assert saved_distributed_optimizer(older) is kind


def test_a_null_setting_follows_the_checkpoint_and_a_differing_one_is_refused(tmp_path):
    plain = _checkpoint(tmp_path / "step_00000002", {"layout": {"dp": 1, "distributed_optimizer": False}})
    assert check_optimizer_kind(plain, None) is False
    assert check_optimizer_kind(plain, False) is False
    with pytest.raises(InputError, match=r"its optimizer state is the plain optimizer's, which "
                                         r"parallel.use_distributed_optimizer=true cannot load .* leave it unset"):
        check_optimizer_kind(plain, True)
    # A DP 1 checkpoint resumed at DP 4 keeps the plain optimizer; the overlapped reduce is still on.
    settings = data_parallel_settings(ParallelConfig(), 4, saved_distributed_optimizer=False)
    assert (settings.distributed_optimizer, settings.overlap_grad_reduce, settings.overlap_param_gather) == (
        False, True, False)
    # A DP 2 checkpoint resumed at DP 1 keeps the distributed optimizer (over one rank).
    assert data_parallel_settings(ParallelConfig(), 1, saved_distributed_optimizer=True).distributed_optimizer
