"""Interleaved (virtual) pipelines end to end: PP 2 x VP 2 and PP 4 x VP 2 (the encoder's work divided
over the ranks, ``encoder_dp=full``) train like one process over
2 steps of the demo images and videos, 8 micro-batches a step: losses, grad norms and every saved
tensor; Qwen3-VL on uneven layouts that keep its DeepStack layers on the first virtual stage;
Qwen3-MoE at PP 2 x VP 2 x EP 2 x DP 2 with the distributed optimizer, overlapped gradient reduction
and balancing; Qwen3-VL and Qwen3-MoE at PP 4 x VP 2. A PP 2 x VP 2 checkpoint resumes
bit for bit at PP 2 x VP 2, and alike at PP 1 (checkpoints hold global layer indices)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.conftest import (
    DEMO_MEDIA_FILES,
    SAVE_AT_END,
    SMALL_VIDEOS,
    assert_close_relative,
    assert_trains_alike,
    grad_norms,
    losses,
    resume_from_copy,
    run_train,
)

# About 3x the worst measured (printed with -s; losses 6.0e-8 when the MoE run was 4 layers, 4.1e-8 now),
# grad norms 3.5e-8 over 2 steps (PP 4 x VP 2, the encoder's work divided over the ranks; 4.0e-7 over the 3 steps
# the module ran before: a third step's larger norms; 4x here, as the figure varies between machines), Adam's
# moments 1.7e-7 and weights 1.3e-5 (a small qkv bias; assert_trains_alike allows the weights 10x).
# Issue 34 asks 1e-5 of losses and grad norms.
LOSS_REL, NORM_REL, CHECKPOINT_REL = 2e-7, 1.5e-7, 4e-6
# 2 steps (the second after an update; both hold images and videos), resumed from step 1.
STEPS = 2
RESUME_STEP = 1
# 8 language layers (PP 4 x VP 2 gives each stage one), 8 micro-batches a step.
ON_DEMO_MEDIA = (
    *DEMO_MEDIA_FILES, "data.seq_len=512", *SMALL_VIDEOS,
    "model.language.num_layers=8", "training.global_batch_size=8",
    f"training.train_steps={STEPS}", "checkpoint.save_interval=1", SAVE_AT_END,
)
PP2_VP2 = ("parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2")


def _train(out: Path, *extra: str, nproc: int = 1, preset: str = "qwen2.5vl-tiny-small-vocab") -> Path:
    run_train(out, *ON_DEMO_MEDIA, *extra, nproc=nproc, preset=preset)
    return out


def _assert_alike(run: Path, reference: Path, what: str) -> None:
    assert_close_relative(losses(run), losses(reference), LOSS_REL, f"losses, {what}")
    assert_close_relative(grad_norms(run), grad_norms(reference), NORM_REL, f"grad norms, {what}")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("pp1"))


@pytest.fixture(scope="module")
def pp2_vp2(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("pp2_vp2"), *PP2_VP2, nproc=2)


def test_pp2_x_vp2_trains_like_one_process(pp2_vp2, one_process):
    assert losses(one_process)[-1] < losses(one_process)[0]
    _assert_alike(pp2_vp2, one_process, "PP 2 x VP 2 vs one process")
    assert_trains_alike(pp2_vp2, one_process, relative=CHECKPOINT_REL)


def test_pp4_x_vp2_with_the_encoder_on_every_rank_trains_like_one_process(tmp_path, one_process):
    # encoder_dp=full: a replica on each rank's first chunk, the step's media divided over the 4 ranks.
    run = _train(tmp_path / "pp4_vp2", "parallel.pipeline_model_parallel_size=4",
                 "parallel.virtual_pipeline_model_parallel_size=2", "parallel.encoder_dp=full",
                 "parallel.vision_tensor_model_parallel_size=1", nproc=4)
    _assert_alike(run, one_process, "PP 4 x VP 2, encoder_dp=full, vs one process")


def test_a_pp2_x_vp2_checkpoint_resumes_bit_for_bit_and_at_pp1(tmp_path, pp2_vp2):
    resume_from_copy(pp2_vp2, tmp_path / "same", RESUME_STEP, *ON_DEMO_MEDIA, *PP2_VP2, nproc=2)
    assert losses(tmp_path / "same") == losses(pp2_vp2)
    assert grad_norms(tmp_path / "same") == grad_norms(pp2_vp2)
    resume_from_copy(pp2_vp2, tmp_path / "pp1", RESUME_STEP, *ON_DEMO_MEDIA)
    _assert_alike(tmp_path / "pp1", pp2_vp2, "PP 2 x VP 2 resumed at PP 1")


# Qwen3-VL at 9 layers and 4 micro-batches, 2 steps (the suite's budget): DeepStack adds vision features
# after the first two layers, so every layout keeps both on the first virtual stage.
QWEN3_VL = ("model.language.num_layers=9", "training.global_batch_size=4")
# Qwen3-MoE at 8 layers (one a virtual stage at PP 4 x VP 2). No load-balancing loss here: its weight over layouts
# is test_moe_ep_train.py's, and a balanced run with it deals rows whole (test_qwen2_moe_train.py).
MOE = ("data.seq_len=256", "model.language.num_layers=8", f"training.train_steps={STEPS}",
       "training.global_batch_size=4", "model.language.moe.aux_loss_coeff=0")


@pytest.fixture(scope="module")
def qwen3_vl_one_process(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("vl_pp1"), *QWEN3_VL, preset="qwen3vl-tiny-small-vocab")


@pytest.fixture(scope="module")
def moe_one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe_one")
    run_train(out, *MOE, preset="qwen3-moe-tiny-small-vocab")
    return out


def test_qwen3_vl_on_an_uneven_layout_trains_like_one_process(tmp_path, qwen3_vl_one_process):
    two = _train(tmp_path / "pp2_vp2", *QWEN3_VL, "parallel.pipeline_model_parallel_size=2",
                 "parallel.pipeline_layout=Ett|tt|tt|tttL", nproc=2, preset="qwen3vl-tiny-small-vocab")
    _assert_alike(two, qwen3_vl_one_process, "Qwen3-VL PP 2 x VP 2 (Ett|tt|tt|tttL) vs one process")


def test_moe_at_pp2_x_vp2_x_ep2_balanced_with_overlapped_reduction_trains_like_one_process(tmp_path, moe_one_process):
    # DP 2 (EP 2 over it): the distributed optimizer, gradient reduction overlapped with the backward
    # (each chunk's started by the schedule), every step re-planned by the balancer (threshold 0).
    run_train(tmp_path / "pp2_vp2", *MOE, *PP2_VP2, "parallel.expert_model_parallel_size=2",
              "parallel.use_distributed_optimizer=true", "parallel.overlap_grad_reduce=true",
              "balance.enabled=true", "balance.threshold=0", nproc=4, preset="qwen3-moe-tiny-small-vocab")
    _assert_alike(tmp_path / "pp2_vp2", moe_one_process, "MoE PP 2 x VP 2 x EP 2 vs one process")


def test_qwen3_vl_and_moe_at_pp4_x_vp2_train_like_one_process(tmp_path, qwen3_vl_one_process, moe_one_process):
    # Issue 34 asks every family at PP 4 x VP 2 too: Qwen3-VL on 8 virtual stages, Qwen3-MoE one layer each.
    four = _train(tmp_path / "vl_pp4_vp2", *QWEN3_VL, "parallel.pipeline_model_parallel_size=4",
                  "parallel.pipeline_layout=Ett|t|t|t|t|t|t|tL", nproc=4, preset="qwen3vl-tiny-small-vocab")
    _assert_alike(four, qwen3_vl_one_process, "Qwen3-VL PP 4 x VP 2 (Ett|t|t|t|t|t|t|tL) vs one process")
    run_train(tmp_path / "moe_pp4_vp2", *MOE, "parallel.pipeline_model_parallel_size=4",
              "parallel.virtual_pipeline_model_parallel_size=2", nproc=4, preset="qwen3-moe-tiny-small-vocab")
    _assert_alike(tmp_path / "moe_pp4_vp2", moe_one_process, "MoE PP 4 x VP 2 vs one process")
