"""gather_from_owners and sum_encoder_grads on two gloo ranks: rows land in order, each gradient row
goes back to the rank that owns it, and a rank owning nothing neither hangs nor gets a gradient."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from loongforge.parallel.encoder_dp import (
    add_encoder_grads,
    gather_from_owners,
    mark_encoder_replicas,
    mark_pipeline_replicas,
    sum_encoder_grads,
)
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


def _gather_with_gradient_group(owner_rows: list[list[int]]) -> None:
    """CP ranks: each weighs the rows differently (its own tokens' loss); the owner gets the sum."""
    rank, n = dist.get_rank(), sum(len(rows) for rows in owner_rows)
    mine = owner_rows[rank]
    local = _rows(n)[mine].clone().requires_grad_(True)
    full = gather_from_owners(local, dist.group.WORLD, [torch.tensor(r, dtype=torch.long) for r in owner_rows],
                              gradient_group=dist.group.WORLD)
    weights = torch.arange(1, n * WIDTH + 1, dtype=torch.float64).reshape(n, WIDTH)
    (full * weights * (rank + 1)).sum().backward()
    assert torch.equal(local.grad, 3 * weights[mine]), (rank, local.grad)


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
        _gather_with_gradient_group([[1], [0, 2]])
        _gather_with_gradient_group([[], [0, 1]])  # rank 0 owns nothing: still in the gradient's sum
        _sum_grads()
    finally:
        dist.destroy_process_group()


def test_gather_from_owners_and_grad_sum_on_two_ranks():
    run_workers(_worker, 2, (free_port(),), timeout_s=120)


class _BucketGroup:
    def __init__(self):
        self.ready = []

    def register_grad_ready(self, param, force_all_reduce=False):
        self.ready.append(param)


class _DDP(torch.nn.Module):
    """What add_encoder_grads reads of megatron's DistributedDataParallel."""

    def __init__(self, params, overlap: bool):
        super().__init__()
        self.ddp_config = type("Config", (), {"overlap_grad_reduce": overlap})()
        self.bucket_group = _BucketGroup()
        self.param_to_bucket_group = {param: self.bucket_group for param in params}


def test_add_encoder_grads_adds_to_main_grad_and_reports_each_parameter_once():
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    for param in params:
        param.main_grad = torch.full_like(param, 0.5)
    grads = [torch.full((2,), 2.0), torch.zeros(3)]  # a zero gradient is reported too
    ddp = _DDP(params, overlap=True)
    add_encoder_grads(ddp, list(zip(params, grads)))
    assert torch.equal(params[0].main_grad, torch.full((2,), 2.5))
    assert torch.equal(params[1].main_grad, torch.full((3,), 0.5))
    assert ddp.bucket_group.ready == params
    quiet = _DDP(params, overlap=False)
    add_encoder_grads(quiet, list(zip(params, grads)))
    assert quiet.bucket_group.ready == []


def test_add_encoder_grads_without_megatron_ddp_accumulates_in_grad():
    param = torch.nn.Parameter(torch.ones(2))
    add_encoder_grads(torch.nn.Module(), [(param, torch.ones(2))])
    add_encoder_grads(torch.nn.Module(), [(param, torch.ones(2))])
    assert torch.equal(param.grad, torch.full((2,), 2.0))


def test_pipeline_replicas_are_left_out_of_the_grad_norm():
    from megatron.core.transformer.module import param_is_not_shared

    tower = torch.nn.Linear(2, 2)
    mark_pipeline_replicas(tower.parameters())
    assert not any(param_is_not_shared(p) for p in tower.parameters())
