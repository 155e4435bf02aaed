"""DeepSeek Sparse Attention's dense warm-up through `loongforge train` (deepseek-v3.2-tiny with the small
vocabulary, 2 layers, 64-token rows under a top-8 indexer): the runner's freezing leaves the indexers alone to train,
so between the checkpoints of steps 1 and 2 every indexer tensor moved and every other one is bit-identical (the
routers' expert bias included: megatron-core moves it after each step unless the stage stops it), and the
step logs the indexer loss and the attention mass the top-k keeps (metrics.jsonl and the console line). Data
parallel 2 (2 micro-batches a rank, against 4 on one) and tensor parallel 2 (half the heads a rank) train the same
objective: their losses, grad norms (the indexers' alone: the KL's weighting over micro-batches and ranks, its
target summed over the TP group's heads) and indexer losses equal one process's."""

from __future__ import annotations

import math

import pytest

from loongforge.convert.mcore_io import McoreReader
from tests.train.conftest import assert_close_relative, grad_norms, losses, run_recorded, step_metric

PRESET = "deepseek-v3.2-tiny-small-vocab"
OPTIONS = ("data.seq_len=64", "model.language.sparse_attention.index_topk=8",
           "model.language.sparse_attention.stage=dense_warmup", "training.train_steps=2", "checkpoint.save_interval=1",
           "optimizer.lr=1e-2", "data.read=global")
# About 3x the worst measured two-process vs one differences (printed with -s): losses bit for bit (the main model
# is frozen); grad norms 2.5e-8 at step 1 (TP 2 sums the target's heads in another order), 6.4e-6 at step 2; indexer
# losses 1.2e-5 (TP 2; DP 2 7.1e-6). Step 2 reads indexers that Adam's first step moved by each gradient over its own magnitude, which
# turns gradients 1e-8 apart into weights further apart.
REL = {"losses": 1e-7, "grad norms": 2e-5, "indexer losses": 4e-5}
FIRST_STEP_GRAD_NORM_REL = 1e-7


@pytest.fixture(scope="module")
def warmup(tmp_path_factory):
    run = tmp_path_factory.mktemp("dsa") / "warmup"
    return run, run_recorded(run, *OPTIONS, nproc=1, preset=PRESET)


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_two_processes_train_the_same_objective(warmup, tmp_path, layout):
    """DP 2: 2 micro-batches a rank against 4 on one (the KL's weighting). TP 2: each rank holds half the heads, so
    the indexer's target sums the heads over the group (sequence parallel on: the indexer gathers its inputs)."""
    one, _ = warmup
    extra = {"dp2": (), "tp2": ("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true")}[layout]
    run_recorded(tmp_path / layout, *OPTIONS, *extra, nproc=2, preset=PRESET)
    two = tmp_path / layout
    for name, read in (("losses", losses), ("grad norms", grad_norms),
                       ("indexer losses", lambda run: step_metric(run, "indexer_loss"))):
        assert_close_relative(read(two), read(one), REL[name], f"{layout} vs 1 process {name}")
    assert_close_relative(grad_norms(two)[:1], grad_norms(one)[:1], FIRST_STEP_GRAD_NORM_REL,
                          f"{layout} vs 1 process, step 1's grad norm")


def test_dense_warmup_trains_the_indexers_alone(warmup):
    run, _ = warmup
    readers = [McoreReader(run / "checkpoints" / f"step_{step:08d}" / "model_optim") for step in (1, 2)]
    weights = [key for key in readers[0].tensors if not key.startswith("optimizer")]
    moved = [key for key in weights if not readers[0].read(key).equal(readers[1].read(key))]
    print(f"\n{len(moved)} of {len(weights)} tensors moved from step 1 to 2: {moved}")
    assert moved == [key for key in weights if ".indexer." in key]


def test_the_step_logs_the_indexer_loss_and_the_topk_mass(warmup):
    run, output = warmup
    kl, mass = step_metric(run, "indexer_loss"), step_metric(run, "indexer_topk_mass")
    print(f"\nindexer loss {kl}, top-8 kept mass {mass}")
    assert len(kl) == len(mass) == 2 and all(math.isfinite(v) and v > 0 for v in kl) and all(0 < v < 1 for v in mass)
    assert "| indexer loss " in output and "| top-k mass " in output
