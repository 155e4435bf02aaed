"""Recording per-rank, per-micro-batch compute observations during real training steps.

``StepRecorder`` installs ``IntervalTimers`` on the model config and reads the run's
``GradSyncClock`` to turn one training step into ``micro_batch`` and ``step`` records (format in
``profile.profile_file``).

Pairing a forward/backward interval with its micro-batch: the runner's micro-batch list is
wrapped so that handing out micro-batch ``i`` (inside megatron's forward-compute interval) tags
that forward with ``i``; backwards run in the order of their forwards (no pipelining and 1F1B
alike), so the k-th backward belongs to the k-th forward.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Optional

from loongforge.profile.features import micro_batch_record, model_sample_costs
from loongforge.profile.timers import GradSyncClock, IntervalTimers

# Per-micro-batch times: wall clock (the step's real duration) and process CPU time (this
# process's own work, unaffected by other processes sharing the cores); see profile.timers.
_MB_TIMES = ("forward_s", "backward_s", "forward_cpu_s", "backward_cpu_s")


class _TaggedBatches(list):
    """The step's micro-batch list; iterating it tells the recorder which micro-batch is current."""

    def __init__(self, items, recorder: "StepRecorder"):
        super().__init__(items)
        self._recorder = recorder

    def __iter__(self):
        for index, item in enumerate(list.__iter__(self)):
            self._recorder.current_micro_batch = index
            yield item


class StepRecorder:
    """Times this rank's micro-batches and gradient sync on the steps it is asked to record."""

    def __init__(self, *, model_cfg, rank: int, layout, warmup_steps: int):
        self.rank = rank
        self.layout = layout
        self.warmup_steps = warmup_steps
        self._model_cfg = model_cfg
        self._config = None
        self._timers: Optional[IntervalTimers] = None
        self._features: list[dict] = []
        self._forwards: deque[int] = deque()
        self._times: dict[int, dict] = {}
        self._grad_sync: Optional[GradSyncClock] = None
        self._grad_sync_start = (0.0, 0.0)  # the clock's totals when the step began
        self._fwd_bwd_s = self._fwd_bwd_cpu_s = 0.0
        self._step_start = (0.0, 0.0)
        self._first_step: Optional[int] = None
        self.current_micro_batch = -1
        self.recording = False

    def attach(self, model_config, device, grad_sync: GradSyncClock) -> None:
        self._config = model_config
        self._timers = IntervalTimers(device, on_stop=self._on_stop)
        self._grad_sync = grad_sync

    def _on_stop(self, name: str, seconds: float, cpu_seconds: float) -> None:
        if name == "forward-compute":
            index = self.current_micro_batch
            self._forwards.append(index)
            times = self._times.setdefault(index, dict.fromkeys(_MB_TIMES, 0.0))
            times["forward_s"] += seconds
            times["forward_cpu_s"] += cpu_seconds
        elif name == "backward-compute" and self._forwards:
            times = self._times[self._forwards.popleft()]
            times["backward_s"] += seconds
            times["backward_cpu_s"] += cpu_seconds
        elif name == "forward-backward":
            self._fwd_bwd_s, self._fwd_bwd_cpu_s = seconds, cpu_seconds

    def begin_step(self, step: int, micro_batches: list) -> list:
        """Start recording ``step``: computes features and installs the timers."""
        if self._first_step is None:
            self._first_step = step
        self.recording = True
        self._features = [micro_batch_record(mb, model_sample_costs(mb, self._model_cfg)) for mb in micro_batches]
        self._forwards.clear()
        self._times = {}
        self._grad_sync_start = (self._grad_sync.total_s, self._grad_sync.total_cpu_s)
        self._fwd_bwd_s = self._fwd_bwd_cpu_s = 0.0
        self.current_micro_batch = -1
        self._config.timers = self._timers
        self._timers.sync()
        self._step_start = (time.perf_counter(), self._timers.cpu_clock())
        return _TaggedBatches(micro_batches, self)

    def end_step(self, step: int, result) -> list[dict]:
        """Stop recording; the step's records (micro-batches, then the step)."""
        self._timers.sync()
        step_s = time.perf_counter() - self._step_start[0]
        step_cpu_s = self._timers.cpu_clock() - self._step_start[1]
        self._config.timers = None
        self.recording = False
        grad_sync_s = self._grad_sync.total_s - self._grad_sync_start[0]
        grad_sync_cpu_s = self._grad_sync.total_cpu_s - self._grad_sync_start[1]
        warmup = step < self._first_step + self.warmup_steps
        common = {"step": step, "rank": self.rank, "warmup": warmup,
                  "dp_rank": self.layout.dp_rank, "tp_rank": self.layout.tp_rank,
                  "pp_rank": self.layout.pp_rank}
        records = []
        for index, features in enumerate(self._features):
            times = self._times.get(index)
            if times is None:  # e.g. a stage that never ran this micro-batch's forward
                continue
            records.append({"kind": "micro_batch", **common, "micro_batch": index, **features,
                            **times})
        records.append({"kind": "step", **common, "num_micro_batches": len(self._features),
                        "step_s": step_s, "fwd_bwd_s": self._fwd_bwd_s,
                        "grad_sync_s": grad_sync_s, "step_cpu_s": step_cpu_s,
                        "fwd_bwd_cpu_s": self._fwd_bwd_cpu_s, "grad_sync_cpu_s": grad_sync_cpu_s,
                        # 1-minute load average: how contended the host was (CPU-shared machines).
                        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None})
        return records
