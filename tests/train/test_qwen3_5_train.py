"""Qwen3.5 (hybrid: Gated DeltaNet and gated attention layers) trains through the same command on the demo
photos: TP 2 x PP 2 (vision TP 2; the first stage holds the linear-attention layer, the second the
full-attention one; DP 2 is family-independent: ``conftest.FAMILY_LAYOUTS``) equals one process over 2 steps
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
LINEAR_ATTENTION = (".self_attention.conv1d", ".self_attention.out_norm", ".self_attention.in_proj", ".vision_model.")
# The decays' gradients sum every token's contribution of both signs to about 1e-6 (Adam's first moment
# after 5 steps: 8e-7), so the summation order of another layout moves them by ~1e-3 of themselves: they
# are held to an absolute bound, 3x the measured 3.8e-10 (2 steps; 6.5e-10 over the 3 steps trained before), instead.
DECAYS, DECAY_MOMENT_BOUND = (".self_attention.A_log", ".self_attention.dt_bias"), 1.2e-9
# The tests' two-layer model (``SMALL_MODEL``): one Gated DeltaNet layer, then the gated attention one.
OPTIONS = ("model.language.layer_types=[linear_attention,full_attention]", "data.source=files",
           f"data.paths=[{DEMO_IMAGES}]", "data.read=global", "data.seq_len=1024", "optimizer.adam_eps=1e-6",
           "training.train_steps=2", "checkpoint.save_interval=1", SAVE_AT_END)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return layout_runs(tmp_path_factory.mktemp(PRESET), PRESET, *OPTIONS, layouts=FAMILY_LAYOUTS)


@pytest.mark.parametrize("layout", ["tp2-pp2"])
def test_layout_trains_like_one_process(runs, layout):
    assert_layout_trains_like_one_process(runs, layout, REL, tensors=LINEAR_ATTENTION, elsewhere=DECAYS)
    readers = [McoreReader(final_checkpoint(runs[name]) / "model_optim") for name in (layout, "dp1")]
    keys = [key for key in readers[1].tensors if key.startswith("optimizer.state.exp_avg.")
            and any(piece in key for piece in DECAYS)]
    assert keys
    worst = max(float((readers[0].read(key).double() - readers[1].read(key).double()).norm()) for key in keys)
    print(f"{layout}: the decays' Adam moments within {worst:.1e} (asserted <= {DECAY_MOMENT_BOUND:.0e})")
    assert worst <= DECAY_MOMENT_BOUND


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
