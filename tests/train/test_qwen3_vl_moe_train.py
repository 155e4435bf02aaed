"""Qwen3-VL-MoE trains through the same command: the qwen3vl-moe-tiny preset (the Qwen3-VL towers and
DeepStack, megatron-core's MoE layer with 8 experts top-2 in every decoder layer, the load-balancing
loss on) runs two steps in one process on the CPU to finite losses, and at learning rate 0 exports
the HF weights it loaded (fused expert tensors included) bit for bit."""

from __future__ import annotations

import math

import torch
import yaml
from safetensors.torch import load_file

from tests.train.conftest import SAVE_AT_END, SMALL_MODEL, grad_norms, losses, run_train, step_metric

PRESET = "qwen3vl-moe-tiny-small-vocab"


def test_qwen3vl_moe_tiny_trains_two_steps(tmp_path):
    run_train(tmp_path, "training.train_steps=2", preset=PRESET)
    assert len(losses(tmp_path)) == 2 and all(math.isfinite(v) for v in losses(tmp_path) + grad_norms(tmp_path))
    # A fresh model's loss starts near ln(vocabulary size).
    assert abs(losses(tmp_path)[0] - math.log(4224)) < 1.0
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["model"]["family"] == "qwen3_vl" and resolved["model"]["language"]["moe"]["num_experts"] == 8
    # megatron's per-layer balance losses summed over the run's 2 layers (the test harness's
    # SMALL_MODEL): each about 1 when balanced (a fresh router), at most num_experts / topk = 4.
    balance = step_metric(tmp_path, "load_balancing_loss")
    assert len(balance) == 2 and all(1.5 <= value <= 8.0 for value in balance), balance


def test_train_loads_and_saves_hf_weights_bit_exact(tmp_path):
    """``loongforge train --preset qwen3vl-moe-tiny checkpoint.load_hf=DIR checkpoint.save_hf=true`` at
    learning rate 0 exports the fused expert tensors it loaded, bit for bit."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from loongforge.config.loader import load_run_config
    from loongforge.models.registry import get_family

    model_cfg = load_run_config(PRESET, overrides=SMALL_MODEL).model  # the run's model
    torch.manual_seed(0)
    hf_model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**get_family("qwen3_vl").config_to_hf(model_cfg)))
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.05)
    hf_model.float().save_pretrained(tmp_path / "hf")
    frozen = ["training.train_steps=1", "optimizer.lr=0", "optimizer.min_lr=0", "optimizer.weight_decay=0",
              SAVE_AT_END]
    run_train(tmp_path / "run", f"checkpoint.load_hf={tmp_path / 'hf'}", "checkpoint.save_hf=true", *frozen,
              preset=PRESET)
    exported = load_file(tmp_path / "run" / "hf" / "model.safetensors")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    assert any(key.endswith(".mlp.experts.gate_up_proj") for key in exported)
    assert all(torch.equal(exported[k], original[k]) for k in original)
