"""Stopping a run on SIGTERM (preemption) or SIGINT (Ctrl-C) at a step boundary, every rank together.

A signal handler may run between any two Python bytecodes, possibly while this rank is inside a
collective, so it only records the signal. At the end of every step the ranks take the MAX of
their records in one small all-reduce: a signal delivered to any one rank (a scheduler signalling
one task, the launcher forwarding it, Ctrl-C reaching the whole process group) stops every rank
after the same step, where the checkpoint is consistent. SIGTERM (15) outranks SIGINT (2) under MAX,
so a preemption still saves when someone also pressed Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, Optional

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The shell's convention for "terminated by signal": 143 for SIGTERM, 130 for SIGINT."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequest:
    """The signal this process received (0: none). The handler is a bound method of this object, so
    no module-level state is needed; ``catch_stop_signals`` installs and removes it."""

    def __init__(self) -> None:
        self.signum = 0

    def record(self, signum: int, frame=None) -> None:
        # Keep the strongest: a SIGINT after a SIGTERM must not cancel the stop-save.
        self.signum = max(self.signum, int(signum))

    def agree(self, group: Optional[dist.ProcessGroup] = None) -> int:
        """The signal every rank acts on (0: keep training): one all-reduce (MAX) of a CPU tensor,
        which goes over gloo (a CPU run's group, and the CPU half of a CUDA run's group)."""
        if not (dist.is_initialized() and dist.get_world_size(group) > 1):
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


@contextlib.contextmanager
def catch_stop_signals() -> Iterator[StopRequest]:
    """Record SIGTERM and SIGINT in the yielded request instead of dying; restore the previous
    handlers afterwards. Off the main thread (Python only lets the main thread install handlers),
    nothing is installed and the request stays empty."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.record) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
