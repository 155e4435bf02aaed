"""One preference-training step: policy and reference forwards over rows of pairs, TRL's loss.

A micro-batch is a packed row of whole pairs (``data.preference``): segment 2i is pair i's chosen side,
2i + 1 its rejected side (``collate`` keys, plus ``num_pairs``). The model's forward with labels gives
each token's loss, -log p of the next token; summed over a side's loss mask (its completion) it is the
side's log-prob. The reference model (frozen, no autograd) runs the same row. ``train.preference_loss``
turns the sums into the loss and TRL's metrics.

Normalisation: megatron-core's schedule (``calculate_per_token_loss``) sums the micro-batches' losses
and divides the gradients by the sum of the counts they return. Each micro-batch returns its pairs as
the count and ``step_pairs x`` its share of the step's loss (``PreferenceLoss.loss`` with the step's
denominators), so the gradients are those of the step's mean over pairs (plus the NLL's token mean),
whatever the split into rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

from loongforge.config.preference import PreferenceConfig
from loongforge.train.preference_loss import NLL_METRIC, PAIR_METRICS, NllTerm, PairLogps, nll_weight, preference_loss
from loongforge.train.step import StepResult, packed_seq_params, weights_changed, to_device

# The report of one micro-batch: the PAIR_METRICS sums, then the loss share, pairs, NLL sum, NLL tokens.
_REPORT = "preference"


@dataclass
class StepCounts:
    """The step's denominators, over all its micro-batches: pairs, and the tokens the NLL runs over."""

    pairs: int
    nll_tokens: float


def side_sums(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, sides: int) -> torch.Tensor:
    """float64 [sides]: ``values`` [1, T] summed under ``mask`` [1, T] over each of the row's first
    ``sides`` segments (the pairs' sides; the padding tail after them is left out)."""
    bounds = cu_seqlens.long()  # [segments + 1]
    segment = torch.bucketize(torch.arange(values.shape[-1], device=values.device), bounds[1:], right=True)  # [T]
    weighted = (values.double() * mask.double())[0]  # [T]
    keep = segment < sides
    return torch.zeros(sides, dtype=torch.float64, device=values.device).index_add_(0, segment[keep], weighted[keep])


def sequence_mask(batch: dict) -> torch.Tensor:
    """float [1, T]: every predicted token of every chosen side (all its real tokens but the last), what
    ORPO's NLL runs over (TRL's ``chosen_nll_loss``: the prompt and the answer)."""
    mask = torch.zeros_like(batch["loss_mask"])
    bounds = batch["cu_seqlens"].tolist()
    for side in range(0, 2 * batch["num_pairs"], 2):
        mask[0, bounds[side]:bounds[side] + batch["sample_lengths"][side] - 1] = 1.0
    return mask


def pair_logps(token_logps: torch.Tensor, reference_logps: Optional[torch.Tensor], batch: dict) -> PairLogps:
    """The row's pairs' summed log-probs [P] (policy with autograd, reference without) and token counts."""
    sides, mask, bounds = 2 * batch["num_pairs"], batch["loss_mask"], batch["cu_seqlens"]
    sums = side_sums(token_logps, mask, bounds, sides)
    tokens = side_sums(torch.ones_like(mask), mask, bounds, sides)
    ref = side_sums(reference_logps, mask, bounds, sides) if reference_logps is not None else None
    return PairLogps(chosen=sums[0::2], rejected=sums[1::2], chosen_tokens=tokens[0::2], rejected_tokens=tokens[1::2],
                     ref_chosen=None if ref is None else ref[0::2], ref_rejected=None if ref is None else ref[1::2])


def nll_mask(batch: dict, settings: PreferenceConfig) -> torch.Tensor:
    """float [1, T]: the tokens the loss's NLL runs over: chosen sides' every predicted token for orpo,
    their completions for rpo_alpha (TRL's "sft" loss over the chosen completions)."""
    if settings.loss == "orpo":
        return sequence_mask(batch)
    chosen = torch.zeros_like(batch["loss_mask"])
    bounds = batch["cu_seqlens"].tolist()
    for side in range(0, 2 * batch["num_pairs"], 2):
        chosen[0, bounds[side]:bounds[side + 1]] = batch["loss_mask"][0, bounds[side]:bounds[side + 1]]
    return chosen


def step_counts(micro_batches: list[dict], settings: PreferenceConfig) -> StepCounts:
    """The step's pairs and NLL tokens, from the micro-batches (this process holds the whole step)."""
    tokens = 0.0
    if nll_weight(settings):
        tokens = sum(float(nll_mask(batch, settings).sum()) for batch in micro_batches)
    return StepCounts(pairs=sum(batch["num_pairs"] for batch in micro_batches), nll_tokens=tokens)


def _model_inputs(batch: dict, head_mask: torch.Tensor) -> dict:
    """The model's keyword arguments; ``head_mask`` [1, T]: where it runs the LM head (the tokens whose
    log-probs are read; elsewhere the per-token loss is 0)."""
    return dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                packed_seq_params=packed_seq_params(batch["cu_seqlens"]), media=batch.get("media"),
                loss_mask=head_mask, padding_mask=batch.get("padding_mask"))


def head_mask(batch: dict, settings: PreferenceConfig) -> torch.Tensor:
    """float [1, T]: the completions, and for orpo also the chosen sides' prompts (its NLL's tokens)."""
    if settings.loss == "orpo":
        return torch.maximum(batch["loss_mask"], sequence_mask(batch))
    return batch["loss_mask"]


def make_preference_forward_step(device: torch.device, reference: Optional[list], settings: PreferenceConfig,
                                 counts: StepCounts) -> Callable:
    """megatron's forward step over one row of pairs: the policy's per-token losses, and the reference's
    (no autograd) when the loss has one; the loss function gives the pairs' share of the step's loss."""

    def forward_step(data_iterator, model):
        batch = to_device(next(data_iterator), device)
        output = model(**_model_inputs(batch, head_mask(batch, settings)))  # [1, T] per-token -log p
        reference_logps = None
        if reference is not None:
            with torch.no_grad():
                reference_logps = -reference[0](**_model_inputs(batch, batch["loss_mask"])).detach()
        return output, partial(_preference_loss, batch, reference_logps, settings, counts)

    return forward_step


def _preference_loss(batch: dict, reference_logps: Optional[torch.Tensor], settings: PreferenceConfig,
                     counts: StepCounts, token_loss: torch.Tensor):
    """(pairs x the share of the step's loss, pairs, report): what megatron's schedule sums and divides."""
    logps = pair_logps(-token_loss, reference_logps, batch)
    nll = None
    if nll_weight(settings):
        mask = nll_mask(batch, settings)
        nll = NllTerm(loss_sum=(token_loss.double() * mask.double()).sum(), tokens=mask.sum().double())
    result = preference_loss(logps, settings, nll=nll, step_pairs=counts.pairs, step_nll_tokens=counts.nll_tokens)
    pairs = torch.tensor(logps.num_pairs, dtype=torch.int, device=token_loss.device)
    zero = torch.zeros((), dtype=torch.float64, device=token_loss.device)
    report = torch.stack([*(result.metric_sums[name].double() for name in PAIR_METRICS),
                          result.loss.detach().double(), pairs.double(),
                          zero if result.nll_sum is None else result.nll_sum.double(),
                          zero if result.nll_tokens is None else result.nll_tokens.double()]).cpu()
    return (result.loss * counts.pairs).float(), pairs, {_REPORT: report}


def step_metrics(reports: list[dict]) -> dict[str, float]:
    """The step's ``loss`` and TRL's metrics (each a mean over the step's pairs; ``nll_loss`` the token
    mean) from the micro-batches' reports."""
    total = torch.stack([report[_REPORT] for report in reports]).sum(0)
    pairs = max(float(total[len(PAIR_METRICS) + 1]), 1.0)
    metrics = {"loss": float(total[len(PAIR_METRICS)])}
    metrics.update({name: float(value) / pairs for name, value in zip(PAIR_METRICS, total)})
    nll_tokens = float(total[-1])
    if nll_tokens:
        metrics[NLL_METRIC] = float(total[-2]) / nll_tokens
    return metrics


def preference_train_step(model, reference: Optional[list], optimizer, scheduler, micro_batches: list[dict], *,
                          settings: PreferenceConfig, device: torch.device,
                          seq_length: int) -> tuple[StepResult, dict[str, float]]:
    """Forward + backward over the step's rows of pairs, optimizer update, LR step (one process: the
    step's counts are this process's micro-batches')."""
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    start = time.perf_counter()
    counts = step_counts(micro_batches, settings)
    reports = get_forward_backward_func()(
        forward_step_func=make_preference_forward_step(device, reference, settings, counts),
        data_iterator=iter(micro_batches), model=model, num_microbatches=len(micro_batches),
        seq_length=seq_length, micro_batch_size=1, forward_only=False)
    update_ok, grad_norm, _ = optimizer.step()
    weights_changed(model)
    lr = optimizer.param_groups[0]["lr"]
    if update_ok:
        scheduler.step(increment=1)
    metrics = step_metrics(reports)
    result = StepResult(loss=metrics["loss"], loss_tokens=sum(batch["num_loss_tokens"] for batch in micro_batches),
                        grad_norm=None if grad_norm is None else float(grad_norm), lr=lr,
                        compute_s=time.perf_counter() - start, skipped=not update_ok)
    return result, metrics
