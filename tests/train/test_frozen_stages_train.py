"""Runs in which a pipeline stage has nothing to train: LoRA on the projector alone, and
training.freeze_language (the alignment stage of a vision-language model). The later stage then
holds no trainable parameter: it joins the gradient norm's all-reduce with a zero of the others' dtype
(mcore_patches ``grad_norm_without_gradients``; gloo aborted the job before), saves and loads no
optimizer state and, under LoRA, no base weight. Both train at PP 2 as at PP 1, and resume exactly."""

from __future__ import annotations

import pytest

from tests.train.conftest import assert_close_relative, grad_norms, losses, resume_from_copy, run_recorded

STEPS = ("training.train_steps=3", "checkpoint.save_interval=2", "optimizer.lr=1e-3")
SETTINGS = {"lora_projector": ("lora.rank=4", "lora.targets=[projector]"),
            "freeze_language": ("training.freeze_language=true",)}
# About 3x the worst measured: LoRA PP 2 vs 1 4.0e-8 (losses; grad norms and freeze_language bit for bit;
# printed with -s).
REL = 1.5e-7


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_stage_without_trainable_parameters_trains_and_resumes(setting, tmp_path):
    options = (*STEPS, *SETTINGS[setting])
    one = run_recorded(tmp_path / "pp1", *options, nproc=1)
    if setting == "lora_projector":
        assert "3,584 trainable parameters" in one  # the projector's adapters alone
    run_recorded(tmp_path / "pp2", *options, "parallel.pipeline_model_parallel_size=2", nproc=2)
    assert losses(tmp_path / "pp1")[-1] < losses(tmp_path / "pp1")[0]
    assert_close_relative(losses(tmp_path / "pp2"), losses(tmp_path / "pp1"), REL, f"{setting} losses, PP 2 vs 1")
    assert_close_relative(grad_norms(tmp_path / "pp2"), grad_norms(tmp_path / "pp1"), REL,
                          f"{setting} grad norms, PP 2 vs 1")
    resume_from_copy(tmp_path / "pp2", tmp_path / "resumed", 2, *options, "parallel.pipeline_model_parallel_size=2",
                     nproc=2)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "pp2")
