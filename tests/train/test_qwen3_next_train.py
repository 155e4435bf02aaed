"""Qwen3-Next (the text family's hybrid decoder: Gated DeltaNet and gated attention layers, routed experts beside a
gated shared expert) under context parallelism: CP 2 (with expert parallelism 2: each of the two ranks holds 4 of
every layer's 8 experts, the shared expert and its gate on both) and CP 4 train like one process over 2 steps of
packed synthetic text rows (every sample padded to a multiple of 8, so each splits into 2 x CP chunks): losses and
grad norms. The recurrent state and the convolution's window pass from rank to rank through Qwen3.5's module
(``models/decoder/linear_attention_cp.py``); Qwen3-Next adds 1-D partial RoPE over the CP ranks' chunks."""

from __future__ import annotations

import pytest

from tests.train.conftest import assert_close_relative, grad_norms, losses, run_train

PRESET = "qwen3-next-tiny-small-vocab"
# About 3x the worst measured (printed with -s): losses 4.9e-8 (CP 4), grad norms 4.6e-7 (CP 2).
LOSS_REL, NORM_REL = 1.5e-7, 1.5e-6
OPTIONS = ("model.language.layer_types=[linear_attention,full_attention]", "model.language.num_layers=2",
           "data.seq_len=512", "data.sample_multiple=8", "training.train_steps=2")


@pytest.fixture(scope="module")
def cp1_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-next-cp1")
    run_train(out, *OPTIONS, preset=PRESET)
    return out


@pytest.mark.parametrize("cp, ep", [(2, 2), (4, 1)])
def test_context_parallel_trains_like_one_process(cp, ep, cp1_run, tmp_path):
    run = run_train(tmp_path / f"cp{cp}", *OPTIONS, f"parallel.context_parallel_size={cp}",
                    f"parallel.expert_model_parallel_size={ep}", nproc=cp, preset=PRESET)
    assert "TP1 x PP1 x DP1" in run.stdout
    assert losses(cp1_run)[-1] < losses(cp1_run)[0]
    assert_close_relative(losses(tmp_path / f"cp{cp}"), losses(cp1_run), LOSS_REL, f"losses, CP {cp} vs CP 1")
    assert_close_relative(grad_norms(tmp_path / f"cp{cp}"), grad_norms(cp1_run), NORM_REL,
                          f"grad norms, CP {cp} vs CP 1")
