"""One optimizer step: megatron-core's forward/backward schedule over this rank's micro-batches.

Loss normalisation: every micro-batch returns the *sum* of its masked token losses and its loss-token
count (``calculate_per_token_loss``); megatron-core's ``finalize_model_grads`` all-reduces the count
over data-parallel ranks and scales the gradients by 1 / (tokens in the whole global batch). The result
therefore does not depend on how samples are split over ranks and micro-batches, which is what lets the
load balancer move samples between ranks without changing the training math.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loongforge.models.decoder.moe_balance import aux_loss_weight, weighted_aux_loss
from loongforge.models.decoder.sparse_attention import take_indexer_statistics, weighted_indexer_loss
from loongforge.models.layers.attention import PaddedRowParams
from loongforge.parallel.context_parallel import ContextShard
from loongforge.profile.timers import cpu_clock

# Per-token tensors [1, T] that a CP rank cuts to its own tokens; positions and cu_seqlens stay the row's.
_CONTEXT_SPLIT_KEYS = ("input_ids", "labels", "loss_mask", "padding_mask")
# Keys of a micro-batch dict that are tensors and travel to the compute device (``media``, a
# ``models.media.MediaBatch``, travels whole).
_TENSOR_KEYS = (*_CONTEXT_SPLIT_KEYS, "position_ids", "cu_seqlens", "media")


@dataclass
class StepResult:
    loss: float  # mean loss per loss token over the global batch
    loss_tokens: int  # loss tokens in the global batch
    grad_norm: Optional[float]
    lr: float
    compute_s: float
    skipped: bool
    # Bytes this rank held for the step's vision features encoded before the pipeline ran
    # (parallel.encoder_dp=full: pixels encoded here, its features, the gathered features); 0 otherwise.
    vision_features_bytes: int = 0
    # Mixture-of-experts models with a load-balancing loss: megatron-core's per-layer losses summed
    # over the layers, without the coefficient, averaged over micro-batches and data-parallel
    # replicas (``models.decoder.moe_balance``); None otherwise.
    load_balancing_loss: Optional[float] = None
    # Multi-token prediction: each MTP layer's loss (the mean over its loss tokens, without the coefficient),
    # averaged over micro-batches and data-parallel replicas; None without MTP layers.
    mtp_losses: Optional[list[float]] = None
    # DeepSeek Sparse Attention: the indexer's KL loss (without the coefficient), the mean over its layers and the
    # step's micro-batches (all data-parallel replicas'), and in dense_warmup the share of the main attention's mass
    # its top-k keeps, averaged likewise (``models.decoder.sparse_attention``); None otherwise.
    indexer_loss: Optional[float] = None
    indexer_topk_mass: Optional[float] = None
    # This rank's pipeline schedule (forward, backward and the gradient finalize over its
    # micro-batches): wall seconds and this process's CPU seconds in it. On a CPU run the difference
    # is the time the rank waited (the pipeline bubble, the gradient all-reduce); ``bench pipeline``.
    pipeline_s: float = 0.0
    pipeline_cpu_s: float = 0.0


def to_device(micro_batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if k in _TENSOR_KEYS and v is not None else v)
            for k, v in micro_batch.items()}


def packed_seq_params(cu_seqlens: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> PaddedRowParams:
    """The row's thd parameters; ``padding_mask`` [1, T] (True on padding) names the padding tail, the last segment
    when it is all padding."""
    cu = cu_seqlens.to(torch.int32)  # [n_segments + 1]
    lengths = cu[1:] - cu[:-1]  # [n_segments]
    max_len = int(lengths.max())
    tail = int(lengths[-1])
    padded = padding_mask is not None and tail > 0 and bool(padding_mask[0, -tail:].all())
    return PaddedRowParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                           max_seqlen_kv=max_len, padding_tokens=tail if padded else 0)


def _masked_loss_sum(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Loss function handed to megatron's schedule: (sum of masked losses, loss tokens, report)."""
    mask = loss_mask.float()  # [b, s]
    loss_sum = (per_token_loss.float() * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm_loss": report}


def make_forward_step(device: torch.device, context_group: Optional[dist.ProcessGroup] = None) -> Callable:
    """megatron's forward step over one micro-batch (a packed row). ``context_group``: the CP group
    of a context-parallel run (None at CP 1); the model then gets this rank's tokens of the row
    (``parallel.context_parallel``), the whole row's positions and cu_seqlens, and the shard."""

    def forward_step(data_iterator, model):
        batch = to_device(next(data_iterator), device)
        packed = packed_seq_params(batch["cu_seqlens"], batch.get("padding_mask"))  # the whole row's
        shard = None
        if context_group is not None:
            shard = ContextShard.of_row(batch["input_ids"], batch["cu_seqlens"], context_group)
            batch = {**batch, **{key: shard.take(batch.get(key)) for key in _CONTEXT_SPLIT_KEYS}}
        output = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            labels=batch["labels"],
            packed_seq_params=packed,
            media=batch.get("media"),
            loss_mask=batch["loss_mask"],
            padding_mask=batch.get("padding_mask"),
            **({} if shard is None else {"context_shard": shard}),
        )
        return output, partial(_masked_loss_sum, batch["loss_mask"])

    return forward_step


def _global_loss_sum(reports: list[dict], is_loss_rank: bool) -> tuple[float, int]:
    """(summed token loss, loss tokens) over micro-batches and over the ranks that own a copy of
    the loss."""
    total = torch.zeros(2, dtype=torch.float64)
    if is_loss_rank:
        for report in reports:
            total += report["lm_loss"].double().cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return float(total[0]), int(total[1])


def _global_loss(reports: list[dict], is_loss_rank: bool) -> tuple[float, int]:
    """The mean loss per loss token over the global batch, and its loss tokens."""
    loss_sum, tokens = _global_loss_sum(reports, is_loss_rank)
    return loss_sum / max(tokens, 1), tokens


class ManualGC:
    """Python garbage collection at the same step on every rank (``training.manual_gc_interval``).

    An automatic collection pauses whichever rank crosses its allocation threshold, mid-step and
    at a different time on each rank: the paused rank is the straggler. Collecting after every
    N-th step on all ranks puts the pause where no rank waits for another.
    """

    def __init__(self, interval: int):
        self.interval = interval
        self._was_enabled = gc.isenabled()
        if interval > 0:
            gc.collect()
            gc.disable()

    def after_step(self, step: int) -> None:
        if self.interval > 0 and step % self.interval == 0:
            gc.collect()

    def close(self) -> None:
        if self.interval > 0 and self._was_enabled:
            gc.enable()


def forward_backward(model, micro_batches: list[dict], *, device: torch.device, seq_length: int,
                     is_loss_rank: bool, context_group: Optional[dist.ProcessGroup] = None) -> list[dict]:
    """megatron-core's schedule over this rank's micro-batches: forward, backward, and the gradient
    finalize (all-reduce, division by the global loss-token count); the loss reports it returns.
    Mixture-of-experts models train their balance loss at the weight ``moe_balance`` documents, sparse attention
    its indexer loss at the same."""
    config = _model_config(model)
    balance, indexer = _has_balance_loss(config), _has_indexer_loss(config)
    with contextlib.ExitStack() as weighting:
        if balance or indexer:
            factor = _aux_loss_factor(micro_batches, is_loss_rank and _first_of_context(context_group))
            if balance:
                weighting.enter_context(weighted_aux_loss(model, factor))
            if indexer:
                weighting.enter_context(weighted_indexer_loss(model, factor))
        return _schedule(model, micro_batches, device=device, seq_length=seq_length, forward_only=False,
                         context_group=context_group)


def _schedule(model, micro_batches: list[dict], *, device: torch.device, seq_length: int,
              forward_only: bool, context_group: Optional[dist.ProcessGroup] = None) -> list[dict]:
    """megatron-core's pipeline schedule for this layout over the micro-batches (one row each);
    ``seq_length`` is the whole row's (megatron divides it by CP for the stages' messages)."""
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # Under the interleaved schedule each model chunk reads the micro-batches through its own iterator.
    iterators = [iter(micro_batches) for _ in model] if len(model) > 1 else iter(micro_batches)
    return get_forward_backward_func()(
        forward_step_func=make_forward_step(device, context_group),
        data_iterator=iterators,
        model=model,
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
    )


def forward_only(model, micro_batches: list[dict], *, device: torch.device, seq_length: int,
                 is_loss_rank: bool, context_group: Optional[dist.ProcessGroup] = None) -> tuple[float, int]:
    """megatron-core's schedule over this rank's micro-batches without a backward and without
    autograd (the caller puts the model in eval mode): the global batch's summed token loss and
    its loss tokens, over all ranks (a collective)."""
    with torch.no_grad():
        reports = _schedule(model, micro_batches, device=device, seq_length=seq_length, forward_only=True,
                            context_group=context_group)
    return _global_loss_sum(reports, is_loss_rank)


def _has_balance_loss(config) -> bool:
    """A mixture-of-experts model trained with megatron-core's load-balancing loss."""
    return bool(getattr(config, "num_moe_experts", None) and getattr(config, "moe_aux_loss_coeff", 0))


def _has_indexer_loss(config) -> bool:
    """A DeepSeek Sparse Attention model (``models.decoder.sparse_attention``)."""
    return getattr(config, "index_stage", None) is not None


def _first_of_context(context_group: Optional[dist.ProcessGroup]) -> bool:
    """The CP ranks of a replica hold the same micro-batches: the first of them counts them."""
    return context_group is None or context_group.rank() == 0


def _aux_loss_factor(micro_batches: list[dict], is_loss_rank: bool) -> float:
    """``moe_balance.aux_loss_weight`` from the global batch's loss tokens and micro-batches (summed
    over the ranks that hold one copy of each replica's batch)."""
    counts = torch.zeros(2, dtype=torch.float64)
    if is_loss_rank:
        counts[0] = sum(mb["num_loss_tokens"] for mb in micro_batches)
        counts[1] = len(micro_batches)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    return aux_loss_weight(int(counts[0]), int(counts[1]))


def _model_config(model: list):
    """The megatron TransformerConfig of the first model chunk (inside megatron's DDP wrapper)."""
    return getattr(getattr(model[0], "module", model[0]), "config", None)


def train_step(model, optimizer, scheduler, micro_batches: list[dict], *, device: torch.device,
               seq_length: int, is_loss_rank: bool,
               context_group: Optional[dist.ProcessGroup] = None) -> StepResult:
    """Forward+backward over ``micro_batches``, optimizer update, LR step.

    ``is_loss_rank``: true on the last pipeline stage's TP rank 0 of every data-parallel replica (on
    each of its CP ranks, which hold a share of the replica's tokens each), so the logged loss counts
    every token once. ``context_group``: the CP group (None at CP 1).
    """
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    start = time.perf_counter()
    vision_bytes = _begin_step(model, micro_batches)
    cpu_seconds = cpu_clock()
    pipeline_start, pipeline_cpu_start = time.perf_counter(), cpu_seconds()
    reports = forward_backward(model, micro_batches, device=device, seq_length=seq_length,
                               is_loss_rank=is_loss_rank, context_group=context_group)
    pipeline_s, pipeline_cpu_s = time.perf_counter() - pipeline_start, cpu_seconds() - pipeline_cpu_start
    update_ok, grad_norm, _ = optimizer.step()
    weights_changed(model)
    compute_s = time.perf_counter() - start
    lr = optimizer.param_groups[0]["lr"]
    if update_ok:
        scheduler.step(increment=1)
    loss, tokens = _global_loss(reports, is_loss_rank)
    indexer_loss, indexer_mass = _indexer_losses(model)
    return StepResult(loss=loss, loss_tokens=tokens,
                      grad_norm=None if grad_norm is None else float(grad_norm), lr=lr,
                      compute_s=compute_s, skipped=not update_ok, vision_features_bytes=vision_bytes,
                      load_balancing_loss=_load_balancing_loss(model, len(micro_batches)),
                      mtp_losses=_mtp_losses(model, len(micro_batches)),
                      indexer_loss=indexer_loss, indexer_topk_mass=indexer_mass,
                      pipeline_s=pipeline_s, pipeline_cpu_s=pipeline_cpu_s)


def weights_changed(model: list) -> None:
    """After the update: FP8 layers' weight copies of this step are stale (``models.layers.fp8``)."""
    for chunk in model:
        cache = getattr(getattr(chunk, "module", chunk), "fp8_weights", None)
        if cache is not None:
            cache.weights_changed()


def _load_balancing_loss(model: list, num_micro_batches: int) -> Optional[float]:
    """The step's load-balancing loss from megatron-core's tracker (reduced over pipeline stages and
    data-parallel ranks by megatron's own helper, a collective), then cleared for the next step."""
    if not _has_balance_loss(_model_config(model)):
        return None
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core.transformer.moe import moe_utils

    name = "load_balancing_loss"
    if name not in moe_utils.get_moe_layer_wise_logging_tracker():
        return None
    moe_utils.reduce_aux_losses_tracker_across_ranks([name])
    value = float(moe_utils.get_moe_layer_wise_logging_tracker()[name]["values"].sum()) / num_micro_batches
    moe_utils.clear_aux_losses_tracker()
    return value


def _mtp_losses(model: list, num_micro_batches: int) -> Optional[list[float]]:
    """The step's multi-token-prediction losses from megatron-core's tracker (on the last pipeline stage;
    averaged over its data-parallel replicas by megatron's helper, then summed over the pipeline stages, the
    others contributing zeros: collectives every rank joins), then cleared for the next step."""
    config = _model_config(model)
    layers = getattr(config, "mtp_num_layers", None)
    if not layers:
        return None
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    if "values" in tracker:
        MTPLossLoggingHelper.reduce_loss_in_tracker()
        values = tracker["values"].detach().to("cpu", torch.float64).clone()
        MTPLossLoggingHelper.clean_loss_in_tracker()
    else:
        values = torch.zeros(layers, dtype=torch.float64)
    pipeline = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(pipeline) > 1:
        dist.all_reduce(values, group=pipeline)
    return [float(value) / num_micro_batches for value in values]


def _indexer_losses(model: list) -> tuple[Optional[float], Optional[float]]:
    """The step's (indexer loss, top-k kept mass in dense_warmup) over every rank (a collective every rank joins):
    the layers' sums over pipeline stages, TP and CP ranks repeating the same values, which the ratio to the
    (layer, micro-batch) count cancels; (None, None) without sparse attention."""
    config = _model_config(model)
    if not _has_indexer_loss(config):
        return None, None
    totals = take_indexer_statistics(model)  # float64 [KL, kept mass, (layer, micro-batch) pairs]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    if totals[2] == 0:
        return None, None
    kl, mass = (float(value) for value in totals[:2] / totals[2])
    return kl, mass if config.dense_warmup else None


def clear_moe_loss_tracker(model: list) -> None:
    """Forget what forwards outside a training step (evaluation) left in megatron-core's MoE loss
    tracker, so the next step logs its own load-balancing loss alone."""
    if not getattr(_model_config(model), "num_moe_experts", None):
        return
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core.transformer.moe import moe_utils

    moe_utils.clear_aux_losses_tracker()


def _begin_step(model: list, micro_batches: list[dict]) -> int:
    """Work a model does once per step before its pipeline runs (``parallel.encoder_dp=full``
    encodes the step's media there: the model's ``begin_step``, collective over its model-parallel
    group); returns the bytes it holds for the step. Its ``finish_step`` runs in the finalize."""
    # A plain list: iterating the runner's list may tell a profiler which micro-batch is running
    # (profile.recorder), and none is yet.
    plain = [micro_batches[i] for i in range(len(micro_batches))]
    held = 0
    for chunk in model:
        begin = getattr(getattr(chunk, "module", chunk), "begin_step", None)
        if begin is not None:
            held += begin(plain)
    return held
