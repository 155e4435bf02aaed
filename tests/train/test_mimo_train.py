"""MiMo-V2-Flash through `loongforge train` (mimo-tiny: full attention in the first and last layers, sliding-window
attention with sink logits in the two between, a dense first layer, then routed experts with the sigmoid router and
its expert bias; the tests' 2 layers: a sliding dense one, then a full sparse one): TP 2 x PP 2 (a layer of each kind
on each stage; the sink logits split over TP with the heads, saved as TP-sharded tensors) trains like one process
over 2 steps of 256-token rows (8 windows): losses, grad norms and Adam's moments (the sinks' included). That run cut
back to step 1 and resumed ends bit-identical: the sinks' TP shards and the expert bias saved and read back. (DP 2 is
family-independent: ``conftest.FAMILY_LAYOUTS``; the expert bias's update over DP ranks is DeepSeek's EP 2 run's,
tests/train/test_deepseek_train.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.conftest import (
    SAVE_AT_END,
    assert_layout_trains_like_one_process,
    assert_resumes_identically,
    run_train,
)

PRESET = "mimo-tiny-small-vocab"
REL = 1.5e-6  # measured: Adam moments 4.9e-7 (the sinks'), losses 1.9e-8
OPTIONS = ("model.language.layer_types=[sliding_attention,full_attention]", "data.seq_len=256", "training.train_steps=2", "optimizer.adam_eps=1e-6", "data.read=global", SAVE_AT_END)
RESUME_STEP = 1


# megatron-core trains MoE layers under TP only with sequence parallelism; the checkpoint at step 1 is resumed
TP2_PP2 = ("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
           "parallel.sequence_parallel=true", "checkpoint.save_interval=1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mimo")
    run_train(root / "dp1", *OPTIONS, preset=PRESET)
    run_train(root / "tp2-pp2", *OPTIONS, *TP2_PP2, nproc=4, preset=PRESET)
    return {"dp1": root / "dp1", "tp2-pp2": root / "tp2-pp2"}


def test_tp2_pp2_trains_like_one_process(runs):
    assert_layout_trains_like_one_process(runs, "tp2-pp2", REL, tensors=(".core_attention.sinks", ".linear_qkv."))


def test_tp2_pp2_resumed_from_step_1_is_bit_identical(runs, tmp_path):
    uninterrupted = runs["tp2-pp2"]
    resumed = tmp_path / "resumed"
    assert_resumes_identically(uninterrupted, resumed, RESUME_STEP, *OPTIONS, *TP2_PP2, nproc=4, preset=PRESET,
                               pieces=(".core_attention.sinks", "mlp.router.expert_bias"))
