"""DeepSeek Sparse Attention's dense warm-up through `loongforge train` (deepseek-v3.2-tiny with the small
vocabulary, 2 layers, 64-token rows under a top-8 indexer): the runner's freezing leaves the indexers alone to train,
so between the checkpoints of steps 1 and 2 every indexer tensor moved and every other one is bit-identical (the
routers' expert bias included: megatron-core moves it after each step unless the stage stops it), and the
step logs the indexer loss and the attention mass the top-k keeps (metrics.jsonl and the console line). Data
parallel 2 (2 micro-batches a rank, against 4 on one) trains the same objective: its losses, grad norms (the
indexers' alone: the KL's weighting over micro-batches and ranks) and indexer losses equal one process's."""

from __future__ import annotations

import math

import pytest

from loongforge.convert.mcore_io import McoreReader
from tests.train.conftest import assert_close_relative, grad_norms, losses, run_recorded, step_metric

PRESET = "deepseek-v3.2-tiny-small-vocab"
OPTIONS = ("data.seq_len=64", "model.language.sparse_attention.index_topk=8",
           "model.language.sparse_attention.stage=dense_warmup", "training.train_steps=2", "checkpoint.save_interval=1",
           "optimizer.lr=1e-2", "data.read=global")
# About 3x the worst measured DP 2 vs 1 differences (printed with -s): grad norms 2.8e-8 (losses bit for bit: the
# main model is frozen), indexer losses 4.4e-6 at step 2 (0 at step 1): that KL reads indexers that Adam's first
# step moved by each gradient over its own magnitude, which turns gradients 2.8e-8 apart into weights further apart.
REL = {"losses": 1e-7, "grad norms": 1e-7, "indexer losses": 1.5e-5}


@pytest.fixture(scope="module")
def warmup(tmp_path_factory):
    run = tmp_path_factory.mktemp("dsa") / "warmup"
    return run, run_recorded(run, *OPTIONS, nproc=1, preset=PRESET)


def test_data_parallel_trains_the_same_objective(warmup, tmp_path):
    one, _ = warmup
    run_recorded(tmp_path / "dp2", *OPTIONS, nproc=2, preset=PRESET)
    two = tmp_path / "dp2"
    for name, read in (("losses", losses), ("grad norms", grad_norms),
                       ("indexer losses", lambda run: step_metric(run, "indexer_loss"))):
        assert_close_relative(read(two), read(one), REL[name], f"DP 2 vs 1 {name}")


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
