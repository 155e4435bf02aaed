"""Validation during training: the loss of each validation set every ``training.eval_interval`` steps.

Each set (``data.valid_paths``, ``data.valid_fraction``: ``data.validation_data``) is a
``DataPipeline`` of its own that every rank reads whole (``data.read=global``, no prefetch thread),
packed and balanced with the run's cost model like training rows. An evaluation restarts every set at
its first sample and runs its first ``training.eval_iters`` global batches through megatron-core's
schedule forward only (pipeline stages included), in eval mode and without autograd: no gradient, no
optimizer step. The loss is the training loss's definition (summed masked token losses over all
ranks' micro-batches, divided by their loss tokens) over the evaluated batches; perplexity is its
exponential.

A run with validation trains exactly as one without: the training pipeline and its prefetch thread
are other objects; the RNG states (torch's, CUDA's and megatron's model-parallel tracker) are
restored after an evaluation; each module's train/eval mode is put back as it was; what training
steps count on the side (the online cost fit records only inside a training step, the expert-load
counter only with autograd) does not see evaluation forwards, and the encoder clock's and the MoE
loss tracker's readings from them are dropped.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from loongforge.data.pipeline import DataPipeline


@dataclass
class ValidationLoss:
    """One set's result at one evaluation."""

    loss: float  # mean loss per loss token over the evaluated batches
    loss_tokens: int
    batches: int  # global batches evaluated (training.eval_iters)
    # The set ran out within the batches: its first samples were evaluated again (a set smaller
    # than eval_iters global batches of packed rows).
    wrapped: bool = False

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # exp overflows a float past ~709

    def as_dict(self) -> dict:
        return {"loss": self.loss, "perplexity": self.perplexity, "loss_tokens": self.loss_tokens,
                "batches": self.batches, "wrapped": self.wrapped}


def rejects_file(out_dir: Path, name: str) -> Path:
    """Where a validation set's skipped samples are listed (rank 0 writes it)."""
    return Path(out_dir) / f"rejects-{name}.jsonl"


# (model chunks, this rank's micro-batches) -> (summed token loss, loss tokens) over all ranks:
# ``train.step.forward_only`` with the run's device, sequence length and loss rank bound
ForwardOnly = Callable[[list, list[dict]], tuple[float, int]]


class ValidationSets:
    """The run's validation sets by name, each evaluated on its first ``eval_iters`` global batches."""

    def __init__(self, pipelines: dict[str, DataPipeline], *, eval_iters: int):
        self.pipelines = pipelines
        self.eval_iters = eval_iters

    def __bool__(self) -> bool:
        return bool(self.pipelines)

    def evaluate(self, model: list, forward: ForwardOnly) -> dict[str, ValidationLoss]:
        """Every set's loss under the current weights; training state is left as it was."""
        with preserved_rng(), eval_mode(model):
            return {name: self._evaluate_set(pipeline, model, forward) for name, pipeline in self.pipelines.items()}

    def _evaluate_set(self, pipeline: DataPipeline, model: list, forward: ForwardOnly) -> ValidationLoss:
        pipeline.restart()
        loss_sum, tokens, wrapped = 0.0, 0, False
        for _ in range(self.eval_iters):
            batch_loss, batch_tokens = forward(model, pipeline.next_step())
            loss_sum, tokens = loss_sum + batch_loss, tokens + batch_tokens
            wrapped = wrapped or bool(pipeline.last_row_epoch)  # rows filled from a second pass
        return ValidationLoss(loss=loss_sum / max(tokens, 1), loss_tokens=tokens, batches=self.eval_iters,
                              wrapped=wrapped)

    def reject_counts(self) -> dict[str, dict[str, int]]:
        return {name: pipeline.reject_counts() for name, pipeline in self.pipelines.items()}

    def close(self) -> None:
        for pipeline in self.pipelines.values():
            pipeline.close()


@contextlib.contextmanager
def eval_mode(model: list) -> Iterator[None]:
    """Every module in eval mode (no dropout, LoRA's included), then each back in its own mode."""
    modes = [(module, module.training) for chunk in model for module in chunk.modules()]
    for chunk in model:
        chunk.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Torch's CPU and CUDA generators and megatron's model-parallel RNG tracker as they were
    before, whatever the evaluation drew."""
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core import tensor_parallel

    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracked: Optional[dict] = tracker.get_states() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if tracked is not None:
            tracker.set_states(tracked)
