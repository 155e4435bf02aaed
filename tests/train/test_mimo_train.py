"""MiMo-V2-Flash through `loongforge train` (mimo-tiny: full attention in the first and last layers, sliding-window
attention with sink logits in the two between, a dense first layer, then routed experts with the sigmoid router and
its expert bias; the tests' 2 layers: a sliding dense one, then a full sparse one): TP 2 x PP 2 (a layer of each kind
on each stage; the sink logits split over TP with the heads, saved as TP-sharded tensors) trains like one process
over 2 steps of 256-token rows (8 windows): losses, grad norms and Adam's moments (the sinks' included). (DP 2 is
family-independent: ``conftest.FAMILY_LAYOUTS``.)"""

from __future__ import annotations

from tests.train.conftest import (
    SAVE_AT_END,
    assert_layout_trains_like_one_process,
    run_train,
)

PRESET = "mimo-tiny-small-vocab"
REL = 1.5e-6  # measured: Adam moments 4.9e-7 (the sinks'), losses 1.9e-8
OPTIONS = ("model.language.layer_types=[sliding_attention,full_attention]", "data.seq_len=256", "training.train_steps=2", "optimizer.adam_eps=1e-6", "data.read=global", SAVE_AT_END)


# megatron-core trains MoE layers under TP only with sequence parallelism
TP2_PP2 = ("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
           "parallel.sequence_parallel=true")


def test_tp2_pp2_trains_like_one_process(tmp_path):
    run_train(tmp_path / "dp1", *OPTIONS, preset=PRESET)
    run_train(tmp_path / "tp2-pp2", *OPTIONS, *TP2_PP2, nproc=4, preset=PRESET)
    runs = {"dp1": tmp_path / "dp1", "tp2-pp2": tmp_path / "tp2-pp2"}
    assert_layout_trains_like_one_process(runs, "tp2-pp2", REL, tensors=(".core_attention.sinks", ".linear_qkv."))
