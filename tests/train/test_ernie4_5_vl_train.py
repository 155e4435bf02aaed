"""ERNIE-4.5-VL trains through the command on the demo photos as its processor sizes them: TP 2 x PP 2 with
sequence parallelism (vision TP 2; the tokens' modality built on every stage from its ids, the modalities split
over each TP group's whole sequence) and activation recompute, and EP 2 (both expert sets split over two
data-parallel ranks) each equal one process (losses, the load-balancing loss, grad norms and Adam moments, both
expert sets, their routers and the resampler included, to 1e-5 relative). Both layers sparse and the balance
loss on: transformers' loss over all sparse layers, its counts summed over each TP group, chained from the
first pipeline stage to the last and its gradient coefficient back, counted in the first forward of a
recomputed layer (``models.decoder.modality_balance``). 2 steps, the second after an update (docs/testing.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shared_data import SHARED_DATA
from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    assert_layout_trains_like_one_process,
    run_train,
    step_metric,
)

PRESET = "ernie4.5vl-tiny-small-vocab"
REL = 1e-5
DEMO_IMAGES = SHARED_DATA / "llamafactory" / "mllm_demo.json"
OPTIONS = ("data.source=files", f"data.paths=[{DEMO_IMAGES}]", "data.read=global", "data.seq_len=1024",
           "optimizer.adam_eps=1e-6", "training.train_steps=2", SAVE_AT_END,
           "model.language.moe.first_dense_layers=0", "model.language.moe.aux_loss_coeff=0.1")
LAYOUTS = {"dp1": ((), 1),
           "tp2-pp2-sp": (("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                           "parallel.sequence_parallel=true", "training.recompute_activations=true"), 4),
           "ep2": (("parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1"), 2)}
TENSORS = (".vision_model.ln.", ".projector.temporal_linear.", ".mlp.text_moe.experts.", ".mlp.vision_moe.experts.",
           ".mlp.text_moe.router.", ".mlp.vision_moe.router.", ".mlp.shared_experts.")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ernie")
    for name, (extra, nproc) in LAYOUTS.items():
        run_train(root / name, *OPTIONS, *extra, nproc=nproc, preset=PRESET)
    return {name: root / name for name in LAYOUTS}


@pytest.mark.parametrize("layout", ["tp2-pp2-sp", "ep2"])
def test_layout_trains_like_one_process(runs, layout):
    assert_layout_trains_like_one_process(runs, layout, REL, tensors=TENSORS)
    balance = step_metric(runs[layout], "load_balancing_loss")
    print(f"load-balancing loss per step {[round(value, 6) for value in balance]}")
    assert min(balance) > 2.0  # E sum_e f P: k = 2 when perfectly even
    assert_close_relative(balance, step_metric(runs["dp1"], "load_balancing_loss"), REL)
