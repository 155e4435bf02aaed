"""Qwen3-VL-MoE trains through the same command: the qwen3vl-moe-tiny preset (the Qwen3-VL towers and
DeepStack, megatron-core's MoE layer with 8 experts top-2 in every decoder layer, the load-balancing
loss on) runs two steps in one process on the CPU to finite losses."""

from __future__ import annotations

import math

import yaml

from tests.train.conftest import grad_norms, losses, run_train, step_metric


def test_qwen3vl_moe_tiny_trains_two_steps(tmp_path):
    run_train(tmp_path, "training.train_steps=2", preset="qwen3vl-moe-tiny")
    assert len(losses(tmp_path)) == 2 and all(math.isfinite(v) for v in losses(tmp_path) + grad_norms(tmp_path))
    # A fresh model's loss starts near ln(vocabulary size).
    assert abs(losses(tmp_path)[0] - math.log(151_936)) < 1.0
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["model"]["family"] == "qwen3_vl" and resolved["model"]["language"]["num_experts"] == 8
    # megatron's per-layer balance losses summed over the run's 2 layers (the test harness's
    # SMALL_MODEL): each about 1 when balanced (a fresh router), at most num_experts / topk = 4.
    balance = step_metric(tmp_path, "load_balancing_loss")
    assert len(balance) == 2 and all(1.5 <= value <= 8.0 for value in balance), balance
