"""The Llama 3 architecture trains on text through the same command: the llama-tiny preset (Llama 3
tokenizer built offline, Llama 3 chat format, text-only synthetic data), with its small test
vocabulary, runs two steps to finite losses."""

from __future__ import annotations

import math

import yaml

from tests.train.conftest import grad_norms, losses, run_train


def test_llama_tiny_trains_two_steps(tmp_path):
    run_train(tmp_path, "training.train_steps=2", preset="llama-tiny-small-vocab")
    assert len(losses(tmp_path)) == 2 and all(math.isfinite(v) for v in losses(tmp_path) + grad_norms(tmp_path))
    # A fresh model's loss starts near ln(vocabulary size): the whole 4,352-id vocabulary is live.
    assert abs(losses(tmp_path)[0] - math.log(4352)) < 1.0
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["data"]["tokenizer"] == "llama3-small" and resolved["model"]["language"]["add_qkv_bias"] is False
