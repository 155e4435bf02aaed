"""Qwen2-MoE through `loongforge train` (qwen2-moe-tiny: Qwen2's attention with q/k/v biases, 8 routed experts with
softmax top-2 left unrenormalised, beside a shared expert whose output a sigmoid gate scales). DP 2 with balancing
re-planning every step and TP 2 x PP 2 (sequence parallel: the shared expert's fc1 / fc2 split over TP, its gate
replicated and fed the sequence shard; one sparse layer a stage) train like one process over 2 steps: losses, grad
norms, tokens per expert, Adam's moments (the shared expert's gate and MLP, the experts, the attention biases) and
weights. The TP 2 x PP 2 run cut back to step 1 and resumed ends bit-identical.

With the preset's load-balancing loss (0.001): megatron-core computes it per micro-batch (a row), so balancing deals
the step's rows whole (``balance.apply``, ``whole_rows``) and DP 2 trains one process's objective. Repacking the
samples instead trained another (the balance loss 2.1e-4 and the router's Adam moments 9.7e-4 from one process's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    assert_resumes_identically,
    assert_state_alike,
    grad_norms,
    launch_runs,
    losses,
    step_metric,
)

PRESET = "qwen2-moe-tiny-small-vocab"
# About 3x the worst measured (printed by `pytest -s`): losses 6.7e-8 (DP 2), grad norms 9.1e-9 (TP 2 x PP 2); Adam's
# moments 3.7e-7, the weights 3.4e-6 (TP 2 x PP 2: the q/k/v biases, which start at 0).
REL = 2e-7
STATE_REL = 1e-5
STEPS = 2
RESUME_STEP = 1
OPTIONS = ("data.seq_len=256", f"training.train_steps={STEPS}", "optimizer.adam_eps=1e-6", "data.read=global",
           SAVE_AT_END)
# The resumed run's checkpoint at step 1.
SAVES_STEP_1 = "checkpoint.save_interval=1"
LAYOUTS = {"dp1": ((), 1),
           "dp2": (("balance.enabled=true", "balance.threshold=0"), 2),
           # megatron-core trains MoE layers under TP only with sequence parallelism
           "tp2-pp2": (("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                        "parallel.sequence_parallel=true", SAVES_STEP_1), 4)}
# Trained parts compared among Adam's moments: the shared expert's sigmoid gate and its MLP, the routed experts,
# the attention's q/k/v biases.
PIECES = (".mlp.shared_experts.gate_weight", ".mlp.shared_experts.linear_fc1", ".mlp.experts.",
          ".self_attention.linear_qkv.bias")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return launch_runs(tmp_path_factory.mktemp("qwen2-moe"), PRESET, *OPTIONS, launches=LAYOUTS)


@pytest.mark.parametrize("layout", ["dp2", "tp2-pp2"])
def test_layout_trains_like_one_process(runs, layout):
    run, reference = runs[layout], runs["dp1"]
    assert len(losses(reference)) == STEPS and losses(reference)[-1] < losses(reference)[0]
    assert_close_relative(losses(run), losses(reference), REL, "losses")
    assert_close_relative(grad_norms(run), grad_norms(reference), REL, "grad norms")
    for key in ("expert_tokens_min", "expert_tokens_max"):
        assert step_metric(run, key) == step_metric(reference, key), key
    balance = step_metric(run, "load_balancing_loss")
    assert len(balance) == STEPS and all(balance)
    assert_close_relative(balance, step_metric(reference, "load_balancing_loss"), REL, "balance losses")
    assert_state_alike(run, reference, STATE_REL, layout, PIECES)
    if layout == "dp2":  # the balancer really moved samples
        assert json.loads((run / "summary.json").read_text())["balance"]["applied_steps"] > 0


def test_tp2_pp2_resumed_from_step_1_is_bit_identical(runs, tmp_path):
    uninterrupted = runs["tp2-pp2"]
    resumed = tmp_path / "resumed"
    extra, nproc = LAYOUTS["tp2-pp2"]
    assert_resumes_identically(uninterrupted, resumed, RESUME_STEP, *OPTIONS, *extra,
                               pieces=(".mlp.shared_experts.gate_weight",), nproc=nproc, preset=PRESET)
