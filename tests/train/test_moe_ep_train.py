"""Qwen3-MoE through `loongforge train` (qwen3-moe-tiny: megatron-core's MoE layer, 8 experts top-2, the
load-balancing loss on), logging its balance loss and tokens per expert each step.

Expert parallelism trains like one expert group: qwen3-moe-tiny with its 8 experts split over two
data-parallel ranks (EP 2) beside TP 2 (sequence parallel, expert TP 1) and beside PP 2 (rows padded to
the full sequence, padding kept out of the routing statistics; each stage's two ranks are EP 2 over DP 2,
as a 2-rank EP 2 job of its own was) gives the per-step losses, grad norms and load-balancing losses of
one process (same data, same initial weights) to 3e-7 over 2 steps, and the same Adam moments and weights
(1.5e-6). Each of those layouts is DP 2, so the balance loss's weight over the data-parallel ranks (a mean
over the global batch's micro-batches, ``models/decoder/moe_balance.py``) is proven against DP 1 on the way.
HF weights go into an EP-2 run and come back out of its checkpoint bit-exact. An EP 2 x TP 2 checkpoint
(expert TP 1, sequence parallel) resumes bit for bit in test_deepseek_train.py, the same layout with the
expert bias's state besides: this module's own resume of it was a 4-rank launch for the same sharding of
the experts' chained optimizers. Each run is validated on the Alpaca demo after its last
step: every layout gives one process's validation loss. The EP 2 x TP 2 run and the HF run compute with
grouped-GEMM experts (``model.language.moe.experts=grouped``; one process with megatron's SequentialMLP, the
CPU's default): the same losses, moments and weights under the same checkpoint names, and HF weights through
the grouped run come back bit-exact."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from loongforge.convert.engine import mcore_to_hf
from tests.shared_data import SHARED_DATA
from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    checkpoint_differences,
    final_checkpoint,
    grad_norms,
    hf_tensors,
    losses,
    run_train,
    step_metric,
    validation_losses,
    worst_relative,
)

PRESET = "qwen3-moe-tiny-small-vocab"
# About 3x the worst measured over ep2-tp2 and ep2-pp2 against one process (printed by `pytest -s -k expert_layout`):
# losses 0, grad norms 8.7e-9, load-balancing losses 0; Adam moments 5.1e-7, weights 3.7e-7 (ep2-tp2 with grouped
# experts, 2026-12-08).
REL = 3e-7
STATE_REL = 1.5e-6
STEPS = 2
# 2 steps of 4 rows of 256 tokens; a checkpoint at the end (compared; the refusal resumes it). A balance
# coefficient large enough that its gradient counts; Adam's epsilon as the other layout tests use.
# Validated after the last step on real text (validation leaves training as it is: issue 32).
OPTIONS = ("data.seq_len=256", f"training.train_steps={STEPS}", SAVE_AT_END,
           "model.language.moe.aux_loss_coeff=0.01", "optimizer.adam_eps=1e-6", "data.read=global",
           f"data.valid_paths=[alpaca={SHARED_DATA / 'llamafactory' / 'alpaca_en_demo.json'}]", "training.eval_iters=1")
EP2 = ("parallel.expert_model_parallel_size=2",)
GROUPED = "model.language.moe.experts=grouped"  # one grouped GEMM per projection (models.layers.grouped_experts)
LAYOUTS = {
    # One process: the EP layouts below are DP 2 (their balance loss weighed over two ranks' micro-batches).
    "ep1": ((), 1),
    "ep2-tp2": ((*EP2, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                 "parallel.expert_tensor_parallel_size=1", GROUPED), 4),
    # Two pipeline stages of one MoE layer each; rows padded to the full sequence there.
    "ep2-pp2": ((*EP2, "parallel.pipeline_model_parallel_size=2"), 4),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-ep")
    for name, (extra, nproc) in LAYOUTS.items():
        proc = run_train(root / name, *OPTIONS, *extra, nproc=nproc, preset=PRESET)
        (root / name / "console.txt").write_text(proc.stdout + proc.stderr)
    return {name: root / name for name in LAYOUTS}


def test_moe_run_learns_and_logs_its_experts(runs):
    run = runs["ep1"]
    assert all(math.isfinite(v) for v in losses(run) + grad_norms(run))
    # A fresh model's loss starts near ln(vocabulary size), and falls.
    assert abs(losses(run)[0] - math.log(4224)) < 1.0 and losses(run)[-1] < losses(run)[0]
    # megatron's per-layer balance losses summed over the run's 2 layers (the test harness's
    # SMALL_MODEL): each about 1 when balanced (a fresh router), at most num_experts / topk = 4.
    balance = step_metric(run, "load_balancing_loss")
    assert all(1.5 <= value <= 8.0 for value in balance), balance
    # Tokens per expert over each step: logged, and in the log line.
    low, high = step_metric(run, "expert_tokens_min"), step_metric(run, "expert_tokens_max")
    load = step_metric(run, "expert_load_max_over_mean")
    assert all(0 <= a <= b for a, b in zip(low, high)) and all(1.0 <= value <= 4.0 for value in load), (low, high, load)
    assert f"experts max/mean {load[-1]:.2f}" in (run / "console.txt").read_text()


@pytest.mark.parametrize("layout", ["ep2-tp2", "ep2-pp2"])
def test_expert_layout_trains_like_one_expert_group(runs, layout):
    run, reference = runs[layout], runs["ep1"]
    assert len(losses(reference)) == STEPS
    experts = "grouped" if GROUPED in LAYOUTS[layout][0] else "sequential"
    assert f"experts: {experts})" in (run / "console.txt").read_text()
    assert_close_relative(losses(run), losses(reference), REL)
    assert_close_relative(grad_norms(run), grad_norms(reference), REL)
    assert_close_relative(step_metric(run, "load_balancing_loss"), step_metric(reference, "load_balancing_loss"), REL)
    # Tokens per expert, summed over every rank: the same routing at every layout.
    for key in ("expert_tokens_min", "expert_tokens_max"):
        assert step_metric(run, key) == step_metric(reference, key), key
    # Validation forward-only with the experts spread as in training: the same loss after the last step.
    (step, validation), = validation_losses(run)["alpaca"]
    (_, expected), = validation_losses(reference)["alpaca"]
    assert step == STEPS and abs(validation - expected) <= REL * expected, (validation, expected)
    differences = checkpoint_differences(run, reference)
    experts = {k: v for k, v in differences.items() if ".experts." in k}
    assert any(k.startswith("optimizer.state.exp_avg.") for k in experts), sorted(experts)[:5]
    moments = {k: v for k, v in differences.items() if k.startswith("optimizer.state.exp_avg")}
    worst = max(moments, key=moments.get)
    assert moments[worst] <= STATE_REL, (worst, moments[worst])
    weights = {k: v for k, v in differences.items() if not k.startswith("optimizer.")}
    worst_weight = max(weights, key=weights.get)
    print(f"{layout} vs ep1: losses {worst_relative(losses(run), losses(reference)):.1e}, grad norms "
          f"{worst_relative(grad_norms(run), grad_norms(reference)):.1e}, moments {moments[worst]:.1e}, "
          f"weights {weights[worst_weight]:.1e} (worst relative difference)")
    assert weights[worst_weight] <= STATE_REL, (worst_weight, weights[worst_weight])


def test_hf_weights_through_an_ep2_run_come_back_bit_exact(runs, tmp_path):
    """The EP-2 x PP-2 run's checkpoint as HF (one tensor per expert), loaded into a new EP-2 run of grouped
    experts (``checkpoint.load_hf``: each rank its experts), saved after a step at learning rate 0 and
    converted back: every tensor equal."""
    hf = tmp_path / "hf"
    mcore_to_hf(final_checkpoint(runs["ep2-pp2"]), hf, progress=False)
    start = hf_tensors(hf)
    assert any(".mlp.experts.7." in key for key in start)  # the second EP rank's last expert
    from_hf = tmp_path / "from_hf"
    run_train(from_hf, *OPTIONS, *EP2, GROUPED, f"checkpoint.load_hf={hf}", "optimizer.lr=0",
              "optimizer.min_lr=0", "training.train_steps=1", nproc=2, preset=PRESET)
    back = tmp_path / "back"
    mcore_to_hf(final_checkpoint(from_hf), back, progress=False)
    end = hf_tensors(back)
    assert sorted(end) == sorted(start)
    different = [key for key in start if not torch.equal(start[key], end[key])]
    assert not different, different[:5]


def test_resuming_at_another_expert_parallel_size_is_refused_in_one_line(runs, tmp_path):
    """megatron-core's optimizer state under EP > 1 is chained per kind of parameter: it does not
    load at another EP size, so the run stops before training with what to do instead. The EP-2 x TP-2
    run resumed by one process (EP 1, TP 1: TP alone would reshard): a single forked process, where EP 1's checkpoint resumed at EP 2 took a
    launcher and two fresh interpreters (13 s) for the same check (saved EP against running EP)."""
    moved = tmp_path / "moved"
    shutil.copytree(runs["ep2-tp2"], moved)
    proc = run_train(moved, *OPTIONS, nproc=1, resume=True, expect_ok=False, preset=PRESET)
    assert proc.returncode == 2, proc.stderr[-3000:]
    saved = final_checkpoint(moved)
    assert (f"error: {saved} was saved at parallel.expert_model_parallel_size=2, this run has 1: resume at 2, "
            f"or start a new run from its weights (loongforge convert {saved} HF_DIR --to hf, then "
            f"checkpoint.load_hf=HF_DIR).") in proc.stderr
