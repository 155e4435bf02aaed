"""The text-only family trains through the same command: DP 2 with balancing re-planning every step
equals one process (losses, grad norms and Adam moments to 1e-5 relative), TP 2 x PP 2 too (its LM head and
loss in chunks of 16 tokens, ``training.loss_chunk_tokens``, against the one process's whole logits), and a
copy of the DP 2 run cut back to step 1 and resumed ends bit-identical to the uninterrupted run. 2 steps
(the second after an update), resumed from step 1, as the other layout proofs (docs/testing.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    checkpoint_differences,
    grad_norms,
    losses,
    resume_from_copy,
    run_train,
)

PRESET = "llm-tiny-small-vocab"
REL = 1e-5
# Text-only synthetic data; 8 query heads in 4 groups so that TP 2 divides both. Adam's epsilon at
# 1e-6 (preset: 1e-8): with 1e-8 a gradient element that is zero up to rounding becomes a full +-lr
# step whose sign depends on the summation order (and on the CPU thread count), which the next steps
# carry into every moment: 2.2e-5 (DP 2) and 3.4e-5 (TP 2 x PP 2, one thread) apart at step 4, with
# losses at 1e-7.
OPTIONS = ("model.language.num_attention_heads=8", "model.language.num_query_groups=4",
           "model.language.head_dim=16", "data.read=global", "optimizer.adam_eps=1e-6",
           "training.train_steps=2", "checkpoint.save_interval=1", SAVE_AT_END)
BALANCED = ("balance.enabled=true", "balance.threshold=0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llm")
    launches = {
        "dp1": ((), 1),
        "dp2": (BALANCED, 2),
        "tp2-pp2": (("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                     "training.loss_chunk_tokens=16"), 4),
    }
    for name, (extra, nproc) in launches.items():
        run_train(root / name, *OPTIONS, *extra, nproc=nproc, preset=PRESET)
    return {name: root / name for name in launches}


def _assert_trains_alike(run: Path, reference: Path) -> None:
    assert_close_relative(losses(run), losses(reference), REL)
    assert_close_relative(grad_norms(run), grad_norms(reference), REL)
    differences = checkpoint_differences(run, reference)
    moments = {k: v for k, v in differences.items() if k.startswith("optimizer.state.exp_avg")}
    assert any(".q_layernorm." in key for key in moments)  # Qwen3's q/k norms are trained
    worst = max(moments, key=moments.get)
    assert moments[worst] <= REL, (worst, moments[worst])


def test_runs_learn_text(runs):
    first, last = losses(runs["dp1"])[0], losses(runs["dp1"])[-1]
    assert last < first


@pytest.mark.parametrize("layout", ["dp2", "tp2-pp2"])
def test_layout_trains_like_one_process(runs, layout):
    _assert_trains_alike(runs[layout], runs["dp1"])


def test_resume_is_exact(runs, tmp_path):
    resumed = tmp_path / "resumed"
    resume_from_copy(runs["dp2"], resumed, 1, *OPTIONS, *BALANCED, nproc=2, preset=PRESET)
    assert losses(resumed) == losses(runs["dp2"])
    differences = checkpoint_differences(resumed, runs["dp2"])
    assert max(differences.values()) == 0.0
