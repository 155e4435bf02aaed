"""Per-process state for the scan and write stages, and an ordered map over worker processes.

Each process maps the input records (``ArrowSamples``) and holds a ``SampleMeasurer``. With the
fork start method the workers inherit the parent's mapping; otherwise they map the Arrow copies
the parent built. Results come back in task order, so the output never depends on ``--workers``.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Union

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.measure import MeasuredSample, SampleMeasurer
from loongforge.data.record_kinds import reading_for
from loongforge.data.samples import Reject
from loongforge.data.tokenizer import load_tokenizer


@dataclass(frozen=True)
class MeasureContext:
    """Everything a process needs to turn a sample index into a measured sample."""

    inputs: tuple[str, ...]
    data_cfg: DataConfig
    model_cfg: ModelConfig


_STATE: dict[str, Any] = {}
_TOKENIZERS: dict[str, Any] = {}  # by data.tokenizer: loading one takes seconds


def _tokenizer(spec: str):
    if spec not in _TOKENIZERS:
        _TOKENIZERS[spec] = load_tokenizer(spec)
    return _TOKENIZERS[spec]


def install(context: MeasureContext, samples: Optional[ArrowSamples] = None) -> None:
    """Make ``context`` current in this process (the parent passes the records it already mapped)."""
    if _STATE.get("context") != context:
        _STATE.clear()
        _STATE["context"] = context
    if samples is not None:
        _STATE["samples"] = samples


def samples() -> ArrowSamples:
    if "samples" not in _STATE:
        context = _STATE["context"]
        _STATE["samples"] = ArrowSamples(list(context.inputs), context.data_cfg.cache_dir,
                                         reading=reading_for(context.data_cfg))
    return _STATE["samples"]


def measurer() -> SampleMeasurer:
    """This process's measurer; loading it before forking workers spares each a tokenizer load."""
    if "measurer" not in _STATE:
        context = _STATE["context"]
        _STATE["measurer"] = SampleMeasurer(_tokenizer(context.data_cfg.tokenizer), context.data_cfg,
                                            context.model_cfg)
    return _STATE["measurer"]


def seq_len() -> int:
    """The pack's row length (``--seq-len``)."""
    return _STATE["context"].data_cfg.seq_len


def measure_index(index: int) -> Union[MeasuredSample, Reject]:
    """Read, validate and measure sample ``index`` of the inputs."""
    sample = samples().get(index)
    return sample if isinstance(sample, Reject) else measurer().measure(sample)


def reject_reason(index: int) -> Optional[str]:
    """Why sample ``index`` of the inputs is rejected; None when it is usable."""
    measured = measure_index(index)
    return measured.reason if isinstance(measured, Reject) else None


def _init_worker(context: MeasureContext) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    install(context)


def map_ordered(function: Callable[[Any], Any], tasks: Iterable[Any], context: MeasureContext,
                workers: int) -> Iterator[Any]:
    """``map(function, tasks)`` in this process (workers <= 1) or over ``workers`` processes,
    yielding results in task order as they complete."""
    if workers <= 1:
        yield from map(function, tasks)
        return
    methods = multiprocessing.get_all_start_methods()
    mp = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with mp.Pool(workers, initializer=_init_worker, initargs=(context,)) as pool:
        yield from pool.imap(function, tasks)
