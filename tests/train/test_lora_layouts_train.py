"""LoRA at the layouts issue 31 names beside TP and PP (tests/train/test_lora_train.py): data
parallelism with the distributed optimizer (the adapters' Adam state sharded over DP 2) and the overlapped
param gather trains like
one process, and Qwen3-MoE with its routed experts adapted trains alike at EP 2 (each expert's
adapters on its expert's rank, reduced over the expert-data-parallel group) and EP 1. Both from an
HF base (``checkpoint.load_hf``), as LoRA is run."""

from __future__ import annotations

from tests.train.conftest import SMALL_MODEL, assert_close_relative, grad_norms, losses, random_hf_folder, run_train

STEPS = ("training.train_steps=3", "optimizer.lr=1e-2", "data.read=global")
# About 3x the worst measured: DP 2 dist-opt 3.0e-8, EP 2 7.0e-9 (printed with -s).
REL = 1e-7


def _base(preset: str, folder) -> str:
    random_hf_folder(preset, list(SMALL_MODEL), folder)
    return f"checkpoint.load_hf={folder}"


def test_lora_with_the_distributed_optimizer_at_dp2_trains_like_one_process(tmp_path):
    preset = "qwen2.5vl-tiny-small-vocab"
    options = (*STEPS, "lora.rank=8", "lora.targets=[language,projector]", _base(preset, tmp_path / "base"))
    run_train(tmp_path / "one", *options, preset=preset)
    # The distributed optimizer by default at DP 2; the overlapped param gather opted in: it waits for the
    # adapters' weights in their own forward pre-hook (2.7e-2 loss difference at step 2 while the adapters
    # ran outside their forward).
    run_train(tmp_path / "dp2", *options, "parallel.overlap_param_gather=true", nproc=2, preset=preset)
    assert losses(tmp_path / "one")[-1] < losses(tmp_path / "one")[0]
    assert_close_relative(losses(tmp_path / "dp2"), losses(tmp_path / "one"), REL, "LoRA losses, DP 2 dist-opt vs 1")
    assert_close_relative(grad_norms(tmp_path / "dp2"), grad_norms(tmp_path / "one"), REL,
                          "LoRA grad norms, DP 2 dist-opt vs 1")


def test_lora_on_routed_experts_trains_alike_at_ep2(tmp_path):
    preset = "qwen3-moe-tiny-small-vocab"
    options = (*STEPS, "data.seq_len=256", "lora.rank=4", "lora.experts=true", "optimizer.adam_eps=1e-6",
               _base(preset, tmp_path / "base"))
    ep1 = run_train(tmp_path / "ep1", *options, nproc=2, preset=preset)
    run_train(tmp_path / "ep2", *options, "parallel.expert_model_parallel_size=2", nproc=2, preset=preset)
    assert "language.expert_fc1" in ep1.stdout + ep1.stderr
    assert_close_relative(losses(tmp_path / "ep2"), losses(tmp_path / "ep1"), REL, "LoRA losses, EP 2 vs EP 1")
    # 8.1e-7 measured in a fresh venv of 2026-12-07 (the same at the commit before that session; 7e-9 in
    # the venv the bound was set in): about 3x it asserted.
    assert_close_relative(grad_norms(tmp_path / "ep2"), grad_norms(tmp_path / "ep1"), 3e-6,
                          "LoRA grad norms, EP 2 vs EP 1")
