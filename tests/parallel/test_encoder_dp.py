"""gather_from_owners and sum_encoder_grads on two gloo ranks: rows land in order, each gradient row
goes back to the rank that owns it, and a rank owning nothing neither hangs nor gets a gradient."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from loongforge.parallel.encoder_dp import gather_from_owners, mark_encoder_replicas, sum_encoder_grads
from tests.models.helpers import free_port, limit_threads, run_workers

WIDTH = 3


def _rows(n: int) -> torch.Tensor:
    """The full result every rank should see: row i = [i, i + 0.1, i + 0.2]."""
    return torch.arange(n, dtype=torch.float64)[:, None] + torch.tensor([0.0, 0.1, 0.2], dtype=torch.float64)


def _gather_and_backward(owner_rows: list[list[int]]) -> None:
    rank, n = dist.get_rank(), sum(len(rows) for rows in owner_rows)
    mine = owner_rows[rank]
    local = _rows(n)[mine].clone().requires_grad_(True)  # [n_mine, 3], in the order listed
    full = gather_from_owners(local, dist.group.WORLD, [torch.tensor(r, dtype=torch.long) for r in owner_rows])
    assert torch.equal(full, _rows(n)), (rank, full)
    # The same upstream gradient on every rank (as a TP group's language model gives it).
    weights = torch.arange(1, n * WIDTH + 1, dtype=torch.float64).reshape(n, WIDTH)
    (full * weights).sum().backward()
    assert torch.equal(local.grad, weights[mine]), (rank, local.grad)


def _sum_grads() -> None:
    rank = dist.get_rank()
    tower = torch.nn.Linear(2, 2, bias=True).double()
    other = torch.nn.Linear(2, 2, bias=False).double()  # not marked: left alone
    mark_encoder_replicas(tower.parameters(), dist.group.WORLD)
    if rank == 0:  # rank 1 encoded nothing: no .grad at all on its tower
        tower(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    other.weight.grad = torch.full((2, 2), float(rank + 1), dtype=torch.float64)
    sum_encoder_grads([tower, other])
    assert torch.equal(tower.weight.grad, torch.ones(2, 2, dtype=torch.float64))
    assert torch.equal(tower.bias.grad, torch.ones(2, dtype=torch.float64))
    assert torch.equal(other.weight.grad, torch.full((2, 2), float(rank + 1), dtype=torch.float64))


def _worker(rank: int, port: int) -> None:
    limit_threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        _gather_and_backward([[2, 0], [1, 3, 4]])  # uneven, out of order
        _gather_and_backward([[0, 1, 2], []])  # rank 1 owns nothing: zero-size rows, same collective
        _sum_grads()
    finally:
        dist.destroy_process_group()


def test_gather_from_owners_and_grad_sum_on_two_ranks():
    run_workers(_worker, 2, (free_port(),), timeout_s=120)
