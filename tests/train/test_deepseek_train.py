"""DeepSeek-V3 through `loongforge train` (deepseek-v3-tiny: multi-latent attention, a dense first layer, then
8 routed experts in 4 groups with the sigmoid router and its expert bias, one shared expert).

The expert bias is trained state: after every step megatron-core moves each expert's bias by the update
rate toward the layer's mean load (the step's tokens per expert summed over TP x DP). Expert parallel 2,
EP 2 x TP 2 (sequence parallel) and pipeline parallel 2 (the dense layer on one stage, the sparse one on
the other) give one process's losses, grad norms and tokens per expert over 2 steps, and the very same
expert bias; EP 2 x TP 2 stopped after step 1 and resumed is bit-identical, the bias included. With a
multi-token-prediction layer the step logs its loss, and PP 2 (the MTP layer and a copy of the embedding on
the last stage) trains like one process. PP 2 is proven with the MTP layer (one launch for both claims). EP 2 x
TP 2 computes its experts with grouped GEMMs (``model.language.moe.experts=grouped``; the others with megatron's
SequentialMLP), so its equality with one process and its bit-identical resume hold for grouped experts too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    assert_resumes_identically,
    assert_state_alike,
    expert_bias,
    final_checkpoint,
    grad_norms,
    hf_tensors,
    launch_runs,
    losses,
    run_train,
    step_metric,
    worst_relative,
)

PRESET = "deepseek-v3-tiny-small-vocab"
REL = 3e-7
STATE_REL = 1.5e-6
STEPS = 2
RESUME_STEP = 1
# 2 steps of 4 rows of 256 tokens; the tests' 2-layer model: layer 0 dense, layer 1 sparse.
OPTIONS = ("data.seq_len=256", f"training.train_steps={STEPS}", "checkpoint.save_interval=1", SAVE_AT_END,
           "optimizer.adam_eps=1e-6", "data.read=global")
EP2 = ("parallel.expert_model_parallel_size=2",)
LAYOUTS = {
    "ep1": ((), 1),
    "ep2": (EP2, 2),
    "ep2-tp2": ((*EP2, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                 "parallel.expert_tensor_parallel_size=1", "model.language.moe.experts=grouped"), 4),
}
BIAS = "mlp.router.expert_bias"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return launch_runs(tmp_path_factory.mktemp("deepseek"), PRESET, *OPTIONS, launches=LAYOUTS)


def test_the_expert_bias_evolves_and_is_saved(runs):
    bias = expert_bias(runs["ep1"])
    assert len(bias) == 1, sorted(bias)  # one sparse layer
    (values,) = bias.values()
    # 2 steps at rate 1e-3: each expert's bias a sum of two +-1e-3 moves (or none on an exactly mean load).
    print(f"expert bias after {STEPS} steps: {[round(v * 1e3) for v in values]} x 1e-3")
    assert any(values) and all(abs(v) <= STEPS * 1e-3 + 1e-9 for v in values)


@pytest.mark.parametrize("layout", ["ep2", "ep2-tp2"])
def test_layout_trains_like_one_process(runs, layout):
    assert len(losses(runs["ep1"])) == STEPS
    _assert_trains_like(runs[layout], runs["ep1"], layout)


def _assert_trains_like(run: Path, reference: Path, layout: str) -> None:
    """Losses and grad norms, tokens per expert, the expert bias, Adam's moments and the weights."""
    assert_close_relative(losses(run), losses(reference), REL)
    assert_close_relative(grad_norms(run), grad_norms(reference), REL)
    for key in ("expert_tokens_min", "expert_tokens_max"):
        assert step_metric(run, key) == step_metric(reference, key), key
    assert expert_bias(run) == expert_bias(reference)
    assert_state_alike(run, reference, STATE_REL, layout, (".self_attention.linear_kv_up_proj.",))


def test_ep2_tp2_resumed_from_step_1_is_bit_identical(runs, tmp_path):
    uninterrupted = runs["ep2-tp2"]
    resumed = tmp_path / "resumed"
    extra, nproc = LAYOUTS["ep2-tp2"]
    assert_resumes_identically(uninterrupted, resumed, RESUME_STEP, *OPTIONS, *extra, pieces=(BIAS,), nproc=nproc,
                               preset=PRESET)


MTP = ("model.language.mtp_num_layers=1", "model.language.mtp_loss_coeff=0.3")


@pytest.fixture(scope="module")
def mtp_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek-mtp")
    run_train(root / "pp1", *OPTIONS, *MTP, preset=PRESET)
    run_train(root / "pp2", *OPTIONS, *MTP, "parallel.pipeline_model_parallel_size=2", nproc=2, preset=PRESET)
    return {"pp1": root / "pp1", "pp2": root / "pp2"}


def test_mtp_loss_is_logged_and_pp2_trains_like_one_process(mtp_runs, runs):
    run, reference = mtp_runs["pp2"], mtp_runs["pp1"]
    mtp = step_metric(reference, "mtp_loss")
    assert len(mtp) == STEPS and all(len(values) == 1 for values in mtp)
    # A fresh model predicts the token two ahead no better than the next one: near ln(vocabulary).
    assert all(abs(values[0] - losses(reference)[i]) < 1.0 for i, values in enumerate(mtp)), (mtp, losses(reference))
    # The MTP layer's gradient moves the shared weights: the decoder's losses differ from the run without it.
    assert losses(reference)[0] == losses(runs["ep1"])[0] and losses(reference)[-1] != losses(runs["ep1"])[-1]
    # PP 2 (the dense layer on one stage, the sparse one and the MTP layer on the other): losses, grad norms,
    # tokens per expert, the expert bias, Adam's moments and weights as one process.
    _assert_trains_like(run, reference, "pp2 (MTP)")
    assert_close_relative([v[0] for v in step_metric(run, "mtp_loss")], [v[0] for v in mtp], REL)
    # The MTP layer's router counts real tokens only at every layout (PP pads rows to the full sequence).
    assert len(expert_bias(run)) == 2
    print(f"MTP loss per step {[round(v[0], 4) for v in mtp]}; pp2 vs pp1: losses "
          f"{worst_relative(losses(run), losses(reference)):.1e}")


def test_checkpoints_convert_both_ways_as_megatron_saves_them(mtp_runs, tmp_path):
    """The MTP run's checkpoint (megatron's own keys: the dense first layer and the sparse one each under keys
    of its own, the MTP layer's) -> HF in DeepSeek's layout; that folder into a run (``checkpoint.load_hf``) and,
    converted to megatron, into another (``checkpoint.load``), each saved after a step at learning rate 0 and
    converted back: every tensor equal."""
    from loongforge.convert.engine import hf_to_mcore, mcore_to_hf

    hf = tmp_path / "hf"
    mcore_to_hf(final_checkpoint(mtp_runs["pp1"]), hf, progress=False)
    start = hf_tensors(hf)
    assert "model.layers.2.eh_proj.weight" in start and "model.layers.2.mlp.gate.e_score_correction_bias" in start
    # transformers' class, which has no MTP layer, loads the folder: every tensor it has, the MTP layer's left over.
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not info["missing_keys"] and info["unexpected_keys"]
    assert all(key.startswith("model.layers.2.") for key in info["unexpected_keys"]), sorted(info["unexpected_keys"])
    hf_to_mcore(hf, tmp_path / "mcore", progress=False)
    frozen = ("optimizer.lr=0", "optimizer.min_lr=0", "training.train_steps=1")
    for name, source in (("load_hf", f"checkpoint.load_hf={hf}"), ("load", f"checkpoint.load={tmp_path / 'mcore'}")):
        run_train(tmp_path / name, *OPTIONS, *MTP, source, *frozen, preset=PRESET)
        back = tmp_path / f"{name}-hf"
        mcore_to_hf(final_checkpoint(tmp_path / name), back, progress=False)
        end = hf_tensors(back)
        assert sorted(end) == sorted(start), name
        different = [key for key in start if key != "model.layers.1.mlp.gate.e_score_correction_bias"
                     and key != "model.layers.2.mlp.gate.e_score_correction_bias" and not start[key].equal(end[key])]
        assert not different, (name, different[:5])
