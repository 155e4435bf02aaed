"""The hooks ``run_training`` calls on a caller's observer (``loongforge profile`` is one).

The interface belongs to the training loop that calls it; callers above ``train`` subclass it.
Every hook is optional: the base class does nothing.
"""

from __future__ import annotations


class TrainingObserver:
    """What ``run_training`` tells an observer, in order."""

    def attach(self, model_config, *, cfg, env, layout, grad_sync) -> None:
        """Called once, after the model and DDP are built and before any step. ``grad_sync`` is the
        run's ``profile.timers.GradSyncClock``."""

    def data_source(self, pipeline):
        """The object the runner draws steps from (``next_step``, ``state_dict``, ...)."""
        return pipeline

    def begin_step(self, step: int, micro_batches: list) -> list:
        """Called before ``train_step``; returns the micro-batches to train on."""
        return micro_batches

    def end_step(self, step: int, result, *, data_wait_s: float) -> None:
        """Called after ``train_step`` with its ``StepResult``."""

    def close(self) -> None:
        """Called once after the last step (all ranks), before the summary."""
