"""A hung rank is named by the ranks whose collective timed out waiting for it (2 processes, gloo)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loongforge.parallel.distributed import init_distributed, shutdown
from loongforge.parallel.launch_env import free_port
from loongforge.parallel.progress import RankProgress


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env = init_distributed("cpu", timeout_s=2)
    progress = RankProgress.of_default_group()
    progress.begin_step(5)
    if rank == 1:
        time.sleep(6)  # hung: never joins the all-reduce
        results.put((rank, "slept"))
    else:
        try:
            dist.all_reduce(torch.zeros(1))
            results.put((rank, "no timeout"))
        except RuntimeError:
            results.put((rank, progress.name_hung_ranks(wait_s=1.0)))
    shutdown(env)


@pytest.mark.timeout(90)
def test_the_rank_that_never_arrived_is_named():
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(free_port(), results), nprocs=2, start_method="spawn")
    reports = dict(results.get() for _ in range(2))
    assert reports[0] == "did not arrive (hung, not waiting for others): rank 1", reports


def test_a_world_of_one_names_nobody():
    assert RankProgress(None, 0, 1).name_hung_ranks(wait_s=1.0) == ""
