"""Qwen3.5 (hybrid: Gated DeltaNet and gated attention layers) trains through the same command on the demo
photos: TP 2 x PP 2 (vision TP 2; the first stage holds the linear-attention layer, the second the
full-attention one; DP 2 is family-independent: ``conftest.FAMILY_LAYOUTS``) and context parallel 2 and 4 (the
recurrent state carried across the CP ranks' chunks of each sample) equal one process over 2 steps
(losses, grad norms and Adam moments, Gated DeltaNet's convolution, decays and gated norm among them, to
1e-5 relative); a run stopped after step 1 and resumed gives the uninterrupted run's steps and final
checkpoint bit for bit. Qwen3.5-MoE at expert parallel 2 trains like one process; ``loongforge encode``'s
stored features train like the frozen online encoder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shared_data import SHARED_DATA
from loongforge.convert.mcore_io import McoreReader
from tests.train.conftest import (
    SAVE_AT_END,
    FAMILY_LAYOUTS,
    assert_layout_trains_like_one_process,
    assert_stored_embeddings_train_like_the_frozen_encoder,
    checkpoint_differences,
    final_checkpoint,
    layout_runs,
    losses,
    resume_from_copy,
    run_train,
)

PRESET = "qwen3.5-tiny-small-vocab"
REL = 1e-5
DEMO_IMAGES = SHARED_DATA / "llamafactory" / "mllm_demo.json"
# Compared at REL among the moments (the gated norm, ``OUT_NORM``, and the decays have bounds of their own).
LINEAR_ATTENTION = (".self_attention.conv1d", ".self_attention.in_proj", ".vision_model.")
# The decays' gradients sum every token's contribution of both signs to about 1e-6 (Adam's first moment
# after 5 steps: 8e-7), so the summation order of another layout moves them by ~1e-3 of themselves: they
# are held to an absolute bound, 3x the measured instead: TP 2 x PP 2 6.3e-10; CP 2 2.7e-9 (its state
# transfers add products of their own; the rule's gradients at CP 2 equal the whole row's to 2.4e-7 of the
# largest in tests/models/test_linear_attention.py).
DECAYS = (".self_attention.A_log", ".self_attention.dt_bias")
DECAY_MOMENT_BOUND = {"tp2-pp2": 1.9e-9, "cp2": 8.1e-9, "cp4": 8.1e-9}
# The gated norm's weight sums every head's and token's gradient; another layout's summation order moves its
# second moment by up to 1.2e-5 of itself (CP 2; TP 2 x PP 2: 1.1e-5): 3x that, its own relative bound.
OUT_NORM, OUT_NORM_BOUND = ".self_attention.out_norm", 3.6e-5
# The tests' two-layer model (``SMALL_MODEL``): one Gated DeltaNet layer, then the gated attention one.
OPTIONS = ("model.language.layer_types=[linear_attention,full_attention]", "data.source=files",
           f"data.paths=[{DEMO_IMAGES}]", "data.read=global", "data.seq_len=1024", "optimizer.adam_eps=1e-6",
           "training.train_steps=2", "checkpoint.save_interval=1", SAVE_AT_END)
# Every sample padded to a multiple of 8, so that CP 2 and CP 4 train the rows their one-process reference does.
CP_OPTIONS = (*OPTIONS, "data.sample_multiple=8")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp(PRESET)
    runs = layout_runs(root, PRESET, *OPTIONS, layouts=FAMILY_LAYOUTS)
    # Context parallel 2 and 4: each rank holds two chunks of every sample; the Gated DeltaNet state is carried
    # across the ranks' chunks, the convolution reads the window another rank holds.
    run_train(root / "cp-dp1", *CP_OPTIONS, preset=PRESET)
    for cp in (2, 4):
        run_train(root / f"cp{cp}", *CP_OPTIONS, f"parallel.context_parallel_size={cp}", nproc=cp, preset=PRESET)
    return {**runs, "cp-dp1": root / "cp-dp1", "cp2": root / "cp2", "cp4": root / "cp4"}


@pytest.mark.parametrize("layout", ["tp2-pp2", "cp2", "cp4"])
def test_layout_trains_like_one_process(runs, layout):
    runs = {layout: runs[layout], "dp1": runs["cp-dp1" if layout.startswith("cp") else "dp1"]}
    assert_layout_trains_like_one_process(runs, layout, REL, tensors=LINEAR_ATTENTION, elsewhere=(*DECAYS, OUT_NORM))
    norm_moments = {key: value for key, value in checkpoint_differences(runs[layout], runs["dp1"]).items()
                    if key.startswith("optimizer.state.exp_avg") and OUT_NORM in key}
    assert norm_moments
    print(f"{layout}: the gated norm's Adam moments within {max(norm_moments.values()):.1e} of themselves "
          f"(asserted <= {OUT_NORM_BOUND:.1e})")
    assert max(norm_moments.values()) <= OUT_NORM_BOUND
    readers = [McoreReader(final_checkpoint(runs[name]) / "model_optim") for name in (layout, "dp1")]
    keys = [key for key in readers[1].tensors if key.startswith("optimizer.state.exp_avg.")
            and any(piece in key for piece in DECAYS)]
    assert keys
    worst = max(float((readers[0].read(key).double() - readers[1].read(key).double()).norm()) for key in keys)
    print(f"{layout}: the decays' Adam moments within {worst:.1e} (asserted <= {DECAY_MOMENT_BOUND[layout]:.1e})")
    assert worst <= DECAY_MOMENT_BOUND[layout]


MOE_PRESET = "qwen3.5-moe-tiny-small-vocab"
MOE_OPTIONS = (*OPTIONS[:-3], "training.train_steps=2", SAVE_AT_END)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp(MOE_PRESET)
    run_train(root / "dp1", *MOE_OPTIONS, preset=MOE_PRESET)
    run_train(root / "ep2", *MOE_OPTIONS, "parallel.expert_model_parallel_size=2", nproc=2, preset=MOE_PRESET)
    return {"dp1": root / "dp1", "ep2": root / "ep2"}


def test_moe_at_expert_parallel_2_trains_like_one_process(moe_runs):
    """Qwen3.5-MoE: each rank holds 4 of the 8 routed experts (the shared expert and its gate on both)."""
    assert_layout_trains_like_one_process(moe_runs, "ep2", REL, elsewhere=DECAYS,
                                          tensors=(".mlp.experts.", ".mlp.shared_experts.gate_weight",
                                                   ".mlp.shared_experts.linear_fc1", ".self_attention.in_proj"))


def test_stopped_and_resumed_run_is_bit_identical(runs, tmp_path):
    reference = runs["dp1"]
    resumed = tmp_path / "resumed"
    resume_from_copy(reference, resumed, 1, *OPTIONS, preset=PRESET)
    assert losses(resumed) == losses(reference)
    differences = checkpoint_differences(resumed, reference)
    print(f"\nresumed after step 1 vs uninterrupted: {len(differences)} tensors, largest difference "
          f"{max(differences.values()):.1e}")
    assert max(differences.values()) == 0.0


def test_stored_embeddings_train_like_the_frozen_encoder(tmp_path):
    """``loongforge encode`` stores Qwen3.5's merged features (no DeepStack sets to keep)."""
    assert_stored_embeddings_train_like_the_frozen_encoder(
        tmp_path, PRESET, DEMO_IMAGES, "model.language.num_layers=2",
        "model.language.layer_types=[linear_attention,full_attention]", "data.seq_len=1024", "data.max_pixels=12544")
