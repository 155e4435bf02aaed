"""Encoder data parallelism inside a group of ranks that share a micro-batch (``parallel.encoder_dp``).

The ranks of a language TP group compute the language model on the same tokens. With a whole
encoder on each of them (vision TP 1), each can encode a different part of the group's images and
videos instead of all of them encoding everything. Two pieces make that exact:

- ``gather_from_owners``: every rank's embeddings, gathered to every rank of the group in the
  media's original order. Its backward hands each rank the gradient rows of the embeddings it
  encoded, and no others, so each encoder backward runs on the owner only. It communicates nothing
  in backward: the gradient of the language model's input is complete and identical on every rank
  of a TP group (megatron's TP regions all-reduce it before it leaves the first layer and the
  embedding), so each rank already holds its own rows.
- ``sum_encoder_grads``: each rank now holds the encoder gradient of its own media only; parameters
  marked with ``mark_encoder_replicas`` get their gradients summed over the group after megatron's
  data-parallel reduction, so every replica of the encoder takes the same, complete step.

``parallel.encoder_dp=full`` (the model-parallel group divides a whole step's media, encoded
before the pipeline runs) uses ``gather_rows`` to deliver the embeddings, ``sum_over_group`` to sum
the encoder gradients over the group before the data-parallel reduction, ``add_encoder_grads`` to
hand them to megatron's DDP, and ``mark_pipeline_replicas`` so the grad norm counts them once.

Which rank owns which medium is ``parallel.media_assign``'s (pure, the same on every rank).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

# The parameter attribute naming the group an encoder replica's gradient is summed over.
GROUP_ATTR = "encoder_dp_group"


class _GatherFromOwners(torch.autograd.Function):
    """forward: local rows [n_mine, h] -> all rows [N, h], placed at ``positions``.
    backward: the rows of the incoming gradient this rank owns, in its local order, summed over
    ``gradient_group`` first when one is given (ranks whose gradients of the rows differ)."""

    @staticmethod
    def forward(ctx, local, group, rows_per_rank, positions, gradient_group):
        rank = dist.get_rank(group)
        full = _all_gather_rows(local, group, rows_per_rank, positions)
        first = sum(rows_per_rank[:rank])
        ctx.save_for_backward(positions[first: first + rows_per_rank[rank]])
        ctx.gradient_group = gradient_group
        return full

    @staticmethod
    def backward(ctx, grad_full):
        (mine,) = ctx.saved_tensors
        if ctx.gradient_group is not None and ctx.gradient_group.size() > 1:
            grad_full = grad_full.contiguous().clone()  # [N, h]: every rank's share of each row's gradient
            dist.all_reduce(grad_full, group=ctx.gradient_group)
        return grad_full[mine], None, None, None, None


def _all_gather_rows(local: torch.Tensor, group: dist.ProcessGroup, rows_per_rank: Sequence[int],
                     positions: torch.Tensor) -> torch.Tensor:
    """[n_mine, h] on each rank -> [N, h] on every rank, row ``positions[j]`` from the j-th row in
    owner-major order. Uneven counts are padded to the largest (gloo has no uneven all-gather)."""
    width = local.shape[-1]
    padded = local.new_zeros(max(rows_per_rank), width)
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in rows_per_rank]
    dist.all_gather(gathered, padded, group=group)
    owner_major = torch.cat([chunk[:rows] for chunk, rows in zip(gathered, rows_per_rank)])
    full = local.new_empty(owner_major.shape)
    full[positions] = owner_major
    return full


def gather_rows(local: torch.Tensor, group: dist.ProcessGroup,
                owner_rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """``gather_from_owners`` without autograd (``parallel.encoder_dp=full`` sends the gradient
    back itself, after the pipeline flush): [n_mine, h] -> [N, h] on every rank of ``group``."""
    rank = dist.get_rank(group)
    if local.shape[0] != len(owner_rows[rank]):
        raise ValueError(f"rank {rank} of the encoder group holds {local.shape[0]} rows but owns "
                         f"{len(owner_rows[rank])}")
    rows_per_rank = [len(rows) for rows in owner_rows]
    if max(rows_per_rank, default=0) == 0:
        return local.new_zeros(0, local.shape[-1])
    positions = torch.tensor([row for rows in owner_rows for row in rows], dtype=torch.long,
                             device=local.device)
    return _all_gather_rows(local.detach(), group, rows_per_rank, positions)


def gather_from_owners(local: torch.Tensor, group: dist.ProcessGroup,
                       owner_rows: Sequence[torch.Tensor],
                       gradient_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Every rank's rows, in the original order: [N, h].

    ``local`` [n_mine, h]: this rank's rows, in the order ``owner_rows[my rank]`` lists them;
    ``owner_rows[r]`` [n_r] int64: the indices (among the N output rows) of the rows rank r holds,
    the same on every rank. A rank owning nothing passes a [0, h] tensor and still takes part:
    every rank of the group must call this whenever any rank owns a row. ``gradient_group``: ranks
    (within ``group``) that each hold part of the rows' gradient (context parallelism): the backward
    sums it over them, a collective every one of them must reach.
    """
    rank = dist.get_rank(group)
    if local.shape[0] != len(owner_rows[rank]):
        raise ValueError(f"rank {rank} of the encoder group holds {local.shape[0]} rows but owns "
                         f"{len(owner_rows[rank])}")
    rows_per_rank = [len(rows) for rows in owner_rows]
    positions = torch.cat(list(owner_rows)).to(device=local.device, dtype=torch.long)
    return _GatherFromOwners.apply(local, group, rows_per_rank, positions, gradient_group)


def touch_with_zero(tensor: torch.Tensor, params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """``tensor`` plus 0 * (one element of each of ``params``): the same values, and in backward a
    zero gradient for every parameter. megatron's DDP with ``overlap_grad_reduce`` starts reducing a
    bucket once each of its parameters has reported a gradient in the last micro-batch, so an
    encoder that took no part in it (no media, or none of them assigned here) must still report."""
    touch = [param.reshape(-1)[:1].sum() for param in params if param.requires_grad]
    if not touch or not torch.is_grad_enabled():
        return tensor
    return tensor + torch.stack(touch).sum().to(tensor.dtype) * 0.0


def mark_encoder_replicas(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    """Flag ``params`` (an encoder replicated over ``group``) for ``sum_encoder_grads``."""
    for param in params:
        setattr(param, GROUP_ATTR, group)


def sum_encoder_grads(modules: Iterable[torch.nn.Module]) -> None:
    """Sum the gradients of every marked parameter over its group, one all-reduce per group.

    Run it after megatron's ``finalize_model_grads``: the data-parallel reduction (which may still
    be in flight with ``overlap_grad_reduce`` until then) and this sum commute. With the distributed
    optimizer the rank-local shard of ``main_grad`` is the valid part after finalize; the ranks of a
    TP group share their data-parallel rank, so they hold the same shard and the sum stays right.
    """
    grads_by_group: dict[int, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
    for module in modules:
        for param in module.parameters():
            group = getattr(param, GROUP_ATTR, None)
            if group is None or not param.requires_grad or group.size() == 1:
                continue
            grad = getattr(param, "main_grad", None)
            if grad is None:  # no megatron DDP: the plain .grad, zero where nothing reached it
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
            grads_by_group.setdefault(id(group), (group, []))[1].append(grad)
    for group, grads in grads_by_group.values():
        sum_over_group(grads, group)


def sum_over_group(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` in place over ``group``: one flattened all-reduce."""
    if not tensors or group.size() == 1:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for tensor, summed in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        tensor.copy_(summed)


def mark_pipeline_replicas(params: Iterable[torch.nn.Parameter]) -> None:
    """Flag an encoder replica on a later pipeline stage as ``shared``, so that megatron's grad
    norm (and zero count), which sums over the whole model-parallel group, leaves it out: its
    gradient equals the first stage's, which is counted (``param_is_not_shared``)."""
    for param in params:
        param.shared = True


def add_encoder_grads(ddp_module: torch.nn.Module,
                      grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """Hand each encoder parameter's gradient of the step to megatron's DDP, as its backward hook
    would have (``DistributedDataParallel._make_backward_post_hook``): add it to ``main_grad`` and,
    with ``overlap_grad_reduce``, report the parameter ready once, so that its bucket starts its
    reduction. Without megatron's DDP (``main_grad`` absent) it is added to ``.grad``.

    Call it after the pipeline flush and before ``finalize_model_grads``, once per step for every
    trainable encoder parameter, also where the gradient is zero: a bucket is reduced only when
    every one of its parameters has reported.
    """
    overlap = getattr(getattr(ddp_module, "ddp_config", None), "overlap_grad_reduce", False)
    for param, grad in grads:
        main_grad = getattr(param, "main_grad", None)
        if main_grad is None:
            param.grad = grad.clone() if param.grad is None else param.grad + grad
            continue
        main_grad.add_(grad)
        if overlap:
            ddp_module.param_to_bucket_group[param].register_grad_ready(
                param, getattr(ddp_module, "force_all_reduce", False))
