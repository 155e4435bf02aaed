"""The reader-alone measurement of ``bench data``, in a module of its own: a spawned process
imports only this module and the readers (no torch, no tokenizer), so its peak RSS is the reader's."""

from __future__ import annotations

import resource
import time

import numpy as np

from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.conversations import FileSamples


def open_reader(reader: str, data: str, cache: str):
    """``reader``: "in-memory" (the baseline) or "arrow"."""
    return FileSamples([data]) if reader == "in-memory" else ArrowSamples([data], cache, progress=False)


def peak_rss() -> int:
    """This process's peak resident set. Linux's ``VmHWM``, not ``ru_maxrss``: the latter carries
    the parent's peak over ``exec``, so a process spawned by a big parent would report the parent's."""
    try:
        with open("/proc/self/status", encoding="utf-8") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reader_main(queue, reader: str, data: str, cache: str, probes: int) -> None:
    """Open the reader, read ``probes`` random samples; report open time, reads/s and peak RSS."""
    start = time.perf_counter()
    samples = open_reader(reader, data, cache)
    open_s = time.perf_counter() - start
    indices = np.random.default_rng(1).integers(0, len(samples), probes)
    start = time.perf_counter()
    for index in indices:
        samples.get(int(index))
    queue.put({"open_s": open_s, "reads_per_s": probes / (time.perf_counter() - start), "peak_rss_bytes": peak_rss()})
