"""MiniMax-M2 through `loongforge train` (minimax-m2-tiny: q/k norms over all heads, RoPE on half of each head's
channels, 8 routed experts with the sigmoid router and its expert bias). TP 2 x PP 2 with sequence parallelism
(``conftest.FAMILY_LAYOUTS``; megatron trains MoE under TP with SP only): each rank normalises its heads with its
shard of the q/k norm weights, the statistics summed over TP, one sparse layer a stage. It gives one process's
losses, grad norms, tokens per expert, expert bias, Adam moments (the q/k norms' included) and weights over 2
steps; that run cut back to step 1 and resumed ends bit-identical (the norms' TP shards and the expert bias saved
and read back)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    assert_resumes_identically,
    assert_state_alike,
    expert_bias,
    grad_norms,
    launch_runs,
    losses,
    step_metric,
)

PRESET = "minimax-m2-tiny-small-vocab"
# About 3x the measured (printed by `pytest -s`).
REL = 1e-7  # measured 2.9e-8 (grad norms), 1.9e-8 (losses)
STATE_REL = 1.5e-6  # measured 6.0e-7 (Adam moments), 4.7e-7 (weights)
STEPS = 2
RESUME_STEP = 1
OPTIONS = ("data.seq_len=256", f"training.train_steps={STEPS}", "checkpoint.save_interval=1", SAVE_AT_END,
           "optimizer.adam_eps=1e-6", "data.read=global")
LAYOUTS = {"dp1": ((), 1),
           "tp2-pp2": (("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                        "parallel.sequence_parallel=true"), 4)}
BIAS = "mlp.router.expert_bias"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return launch_runs(tmp_path_factory.mktemp("minimax-m2"), PRESET, *OPTIONS, launches=LAYOUTS)


def test_tp2_pp2_trains_like_one_process(runs):
    run, reference = runs["tp2-pp2"], runs["dp1"]
    assert len(losses(reference)) == STEPS and losses(reference)[-1] < losses(reference)[0]
    assert_close_relative(losses(run), losses(reference), REL)
    assert_close_relative(grad_norms(run), grad_norms(reference), REL)
    for key in ("expert_tokens_min", "expert_tokens_max"):
        assert step_metric(run, key) == step_metric(reference, key), key
    bias = expert_bias(reference)
    (layers,) = bias.values()  # megatron stacks the two layers' biases
    assert len(layers) == 2 and all(any(values) for values in layers)
    assert expert_bias(run) == bias
    assert_state_alike(run, reference, STATE_REL, "tp2-pp2", (".q_layernorm.", ".k_layernorm."))


def test_tp2_pp2_resumed_from_step_1_is_bit_identical(runs, tmp_path):
    uninterrupted = runs["tp2-pp2"]
    resumed = tmp_path / "resumed"
    extra, nproc = LAYOUTS["tp2-pp2"]
    assert_resumes_identically(uninterrupted, resumed, RESUME_STEP, *OPTIONS, *extra, pieces=(BIAS, ".k_layernorm."),
                               nproc=nproc, preset=PRESET)
