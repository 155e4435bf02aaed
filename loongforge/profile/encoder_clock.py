"""Per-rank time in the vision encoder (vision tower + projector), forward and backward.

``parallel.encoder_dp`` changes how much of a micro-batch's encoding each rank does, and nothing
else in the step measures that on its own: megatron's compute timers cover the whole forward and
backward. This clock hooks the two modules it is given, ``towers`` (the vision tower, then the
projector that consumes its output):

- forward: from the first tower's forward pre-hook to the last tower's forward hook. A rank that
  encodes nothing in a micro-batch (a text-only micro-batch; ``encoder_dp=tp`` giving its media to
  other ranks) calls neither tower and counts nothing.
- backward: from the moment the gradient of the last tower's output arrives (a hook on that
  tensor) to the moment the gradient of every trainable encoder parameter is computed (a hook on
  each parameter, counted down; unlike torch's multi-grad hook this also works inside
  ``torch.autograd.grad``, which ``encoder_dp=full`` runs the encoder's backward with). A backward
  that never reaches the output (the same
  cases: the encoder's parameters still get a zero gradient so megatron's buckets fill) opens no
  interval, so it counts nothing either. Backwards run whole, one at a time, so one open interval
  at a time is enough, pipelining included.

Clocks, as ``profile.timers``: on CPU the wall clock and the CPU clock (this thread's or process's
work only, immune to other processes on the cores; autograd runs CPU backwards on the calling
thread); on CUDA a pair of events per interval, resolved at ``take`` (no synchronisation inside
the step), with the host's CPU time kept too.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from loongforge.profile.timers import cpu_clock


@dataclass
class EncoderTime:
    """Encoder seconds on one rank over some steps: wall (device time on CUDA) and CPU."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_cpu_s: float = 0.0
    backward_cpu_s: float = 0.0
    forwards: int = 0  # tower forward calls: micro-batches this rank encoded something in

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def total_cpu_s(self) -> float:
        return self.forward_cpu_s + self.backward_cpu_s


class EncoderClock:
    """Running encoder time of this rank; ``take`` returns it since the previous ``take``."""

    def __init__(self, towers: Sequence[torch.nn.Module], device: torch.device):
        if not towers:
            raise ValueError("EncoderClock needs at least one module to time")
        self._cuda = device.type == "cuda"
        self._cpu_clock = cpu_clock()
        self._forward_start: Optional[tuple] = None
        self._backward_start: Optional[tuple] = None
        # (phase, start mark, end mark) of finished intervals not yet taken.
        self._intervals: list[tuple[str, tuple, tuple]] = []
        self._forwards = 0
        self._handles = [towers[0].register_forward_pre_hook(self._tower_starts),
                         towers[-1].register_forward_hook(self._tower_ends)]
        trainable = [p for tower in towers for p in tower.parameters() if p.requires_grad]
        self._trainable = frozenset(range(len(trainable)))
        self._waiting: set[int] = set()  # parameters whose gradient the open backward still owes
        for index, param in enumerate(trainable):
            self._handles.append(param.register_hook(functools.partial(self._gradient_computed, index)))

    def _mark(self) -> tuple:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event, self._cpu_clock()
        return time.perf_counter(), self._cpu_clock()

    def _tower_starts(self, module, args) -> None:
        self._forward_start = self._mark()

    def _tower_ends(self, module, args, output) -> None:
        if self._forward_start is None:
            return
        self._intervals.append(("forward", self._forward_start, self._mark()))
        self._forward_start = None
        self._forwards += 1
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._output_gradient_arrives)

    def _output_gradient_arrives(self, grad: torch.Tensor) -> None:
        self._backward_start = self._mark()
        self._waiting = set(self._trainable)

    def _gradient_computed(self, index: int, grad: torch.Tensor) -> None:
        if self._backward_start is None:  # a backward that did not pass through the encoder
            return
        self._waiting.discard(index)
        if not self._waiting:
            self._intervals.append(("backward", self._backward_start, self._mark()))
            self._backward_start = None

    def take(self) -> EncoderTime:
        """Encoder time since the previous ``take`` (on CUDA: waits for the intervals' ends)."""
        result = EncoderTime(forwards=self._forwards)
        for phase, (start, start_cpu), (end, end_cpu) in self._intervals:
            if self._cuda:
                end.synchronize()
                seconds = start.elapsed_time(end) / 1000.0
            else:
                seconds = end - start
            setattr(result, f"{phase}_s", getattr(result, f"{phase}_s") + seconds)
            setattr(result, f"{phase}_cpu_s", getattr(result, f"{phase}_cpu_s") + end_cpu - start_cpu)
        self._intervals, self._forwards = [], 0
        return result

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
