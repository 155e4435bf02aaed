"""Qwen3-Next (the text family's hybrid decoder: Gated DeltaNet and gated attention layers, routed experts beside a
gated shared expert) under context parallelism: CP 2 (with expert parallelism 2: each of the two ranks holds 4 of
every layer's 8 experts, the shared expert and its gate on both) and CP 4 train like one process over 2 steps of
packed synthetic text rows (every sample padded to a multiple of 8, so each splits into 2 x CP chunks): losses and
grad norms. The recurrent state and the convolution's window pass from rank to rank through Qwen3.5's module
(``models/decoder/linear_attention_cp.py``); Qwen3-Next adds 1-D partial RoPE over the CP ranks' chunks. The CP 2 x
EP 2 run cut back to step 1 and resumed ends bit-identical: Gated DeltaNet's convolution, decays and gated norm, the
experts' EP shards (their own chained optimizer), the shared expert and its gate saved and read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    assert_resumes_identically,
    grad_norms,
    losses,
    run_train,
)

PRESET = "qwen3-next-tiny-small-vocab"
# About 3x the worst measured (printed with -s): losses 4.9e-8 (CP 4), grad norms 4.6e-7 (CP 2).
LOSS_REL, NORM_REL = 1.5e-7, 1.5e-6
OPTIONS = ("model.language.layer_types=[linear_attention,full_attention]", "model.language.num_layers=2",
           "data.seq_len=512", "data.sample_multiple=8", "training.train_steps=2")
# name -> (CP, EP); the CP 2 x EP 2 run saves at steps 1 and 2 for its resume.
LAYOUTS = {"cp2": (2, 2), "cp4": (4, 1)}
RESUMED = "cp2"
SAVES = ("checkpoint.save_interval=1", SAVE_AT_END)
RESUME_STEP = 1


def _layout_options(name: str) -> tuple[str, ...]:
    cp, ep = LAYOUTS[name]
    return (*OPTIONS, f"parallel.context_parallel_size={cp}", f"parallel.expert_model_parallel_size={ep}",
            *(SAVES if name == RESUMED else ()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3-next")
    run_train(root / "cp1", *OPTIONS, preset=PRESET)
    for name, (cp, _) in LAYOUTS.items():
        run = run_train(root / name, *_layout_options(name), nproc=cp, preset=PRESET)
        assert "TP1 x PP1 x DP1" in run.stdout
    return {name: root / name for name in ("cp1", *LAYOUTS)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_trains_like_one_process(layout, runs):
    cp1_run = runs["cp1"]
    assert losses(cp1_run)[-1] < losses(cp1_run)[0]
    assert_close_relative(losses(runs[layout]), losses(cp1_run), LOSS_REL, f"losses, {layout} vs CP 1")
    assert_close_relative(grad_norms(runs[layout]), grad_norms(cp1_run), NORM_REL, f"grad norms, {layout} vs CP 1")


def test_cp2_ep2_resumed_from_step_1_is_bit_identical(runs, tmp_path):
    uninterrupted = runs[RESUMED]
    resumed = tmp_path / "resumed"
    assert_resumes_identically(uninterrupted, resumed, RESUME_STEP, *_layout_options(RESUMED),
                               nproc=LAYOUTS[RESUMED][0], preset=PRESET,
                               pieces=(".self_attention.conv1d", ".self_attention.A_log", ".self_attention.out_norm",
                                       ".mlp.experts.", ".mlp.shared_experts.gate_weight"))
