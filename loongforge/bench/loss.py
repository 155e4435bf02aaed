"""``loongforge bench loss``: the LM head's loss step (projection, cross-entropy, their backward) with the whole
logits (megatron-core's head: ``F.linear`` and ``tensor_parallel.vocab_parallel_cross_entropy``, as
``LanguageModel`` runs them with ``training.loss_chunk_tokens=0``) against the chunked one
(``models.decoder.chunked_loss`` at ``--chunk-tokens``), on one process at TP 1.

Each path runs in a fresh process (``bench.processes``) holding only its inputs: the hidden states [n, h],
the head's weight [V, h] and the labels. Memory is the resident set's high-water mark over the step (Linux's
``VmHWM``, reset just before the step through ``/proc/self/clear_refs``) less the resident set before it:
every byte the step touches, torch's allocations and anything else, which on CPU is what a tensor's bytes
cost (glibc serves blocks this large from ``mmap`` and returns them when freed). It includes the step's
outputs: the loss and the gradients of the hidden states and of the weight (V x h x 4 bytes in fp32, the
same in both paths). Time is the step's wall clock and its process CPU time (at ``--threads 1`` the
compute alone, which a machine shared with other work slows the least), each the median of ``--steps`` after
one untimed step.
"""

from __future__ import annotations

import dataclasses
import platform
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core import tensor_parallel

from loongforge.bench.processes import run_spawned
from loongforge.config.schema import SUGGESTED_LOSS_CHUNK_TOKENS, ParallelConfig
from loongforge.models.decoder.chunked_loss import chunked_cross_entropy
from loongforge.parallel.distributed import init_distributed, init_model_parallel, shutdown
from loongforge.train.runner import library_versions

PATHS = ("whole", "chunked")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_CLEAR_REFS = "/proc/self/clear_refs"


@dataclass
class LossBenchOptions:
    tokens: int = 4096
    vocab_size: int = 152064  # Qwen2's padded vocabulary
    # The head's width: the logits' size does not depend on it, the GEMMs' time and the weight's gradient do.
    hidden_size: int = 128
    chunk_tokens: int = SUGGESTED_LOSS_CHUNK_TOKENS
    dtype: str = "fp32"
    steps: int = 2
    threads: int = 1
    seed: int = 0


def run_loss_bench(opts: LossBenchOptions, log: Callable[[str], None] = lambda _: None, *,
                   start_method: str = "spawn") -> dict:
    """Both paths, one fresh process each (one after the other: neither's time shares the cores); the result
    dict ``format_markdown`` renders. ``start_method``: ``run_spawned``'s test hook."""
    rows = []
    for path in PATHS:
        log(f"{path} logits: {opts.tokens:,} tokens x {opts.vocab_size:,} vocabulary")
        rows.extend(run_spawned(measure_main, [(path, dataclasses.asdict(opts))], what=f"bench loss ({path})",
                                start_method=start_method))
    logits_bytes = opts.tokens * opts.vocab_size * 4
    peaks = {row["path"]: row["peak_bytes"] for row in rows}
    cpu_seconds = {row["path"]: row["step_cpu_s"] for row in rows}
    return {"options": dataclasses.asdict(opts), "environment": {"platform": platform.platform(), **library_versions()},
            "rows": rows, "fp32_logits_bytes": logits_bytes, "chunked_peak_of_logits": peaks["chunked"] / logits_bytes,
            "chunked_peak_of_whole_peak": peaks["chunked"] / peaks["whole"],
            "chunked_cpu_time_of_whole": cpu_seconds["chunked"] / cpu_seconds["whole"]}


def measure_main(queue, path: str, options: dict) -> None:
    """One path's step in this (fresh) process: {path, peak_bytes, step_s, loss} on ``queue``."""
    opts = LossBenchOptions(**options)
    torch.set_num_threads(opts.threads)
    env = init_distributed("cpu")
    try:
        init_model_parallel(ParallelConfig(), seed=opts.seed, device=env.device)
        queue.put({"path": path, **_measure(path, opts)})
    finally:
        shutdown(env)


def _measure(path: str, opts: LossBenchOptions) -> dict:
    dtype = _DTYPES[opts.dtype]
    generator = torch.Generator().manual_seed(opts.seed)
    # logits of a trained model's size (std about 1)
    hidden = torch.randn(opts.tokens, opts.hidden_size, generator=generator).to(dtype).requires_grad_()  # [n, h]
    weight = (torch.randn(opts.vocab_size, opts.hidden_size, generator=generator)
              / opts.hidden_size**0.5).to(dtype).requires_grad_()  # [V, h]
    labels = torch.randint(0, opts.vocab_size, (opts.tokens,), generator=generator)  # [n]

    def step() -> float:
        hidden.grad = weight.grad = None
        if path == "whole":
            logits = torch.nn.functional.linear(hidden, weight)  # [n, V]
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits[:, None], labels[:, None])[:, 0]
        else:
            loss = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=opts.chunk_tokens,
                                         true_vocab_size=opts.vocab_size)
        objective = loss.mean()
        objective.backward()
        return objective.item()

    step()  # untimed: the first call's one-off costs (thread pools, lazy initialisation)
    hidden.grad = weight.grad = None
    before = _resident_bytes()
    _reset_peak()
    seconds, cpu_seconds, loss = [], [], 0.0
    for _ in range(opts.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = step()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    return {"peak_bytes": _peak_bytes() - before, "step_s": statistics.median(seconds),
            "step_cpu_s": statistics.median(cpu_seconds), "loss": loss}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE).group(1)) * 1024


def _resident_bytes() -> int:
    return _status_bytes("VmRSS")


def _peak_bytes() -> int:
    return _status_bytes("VmHWM")


def _reset_peak() -> None:
    """The high-water mark back to the present resident set (Linux 4.0+)."""
    try:
        with open(_CLEAR_REFS, "w", encoding="utf-8") as clear_refs:
            clear_refs.write("5")
    except OSError as error:
        raise RuntimeError(f"bench loss measures the peak resident set through {_CLEAR_REFS} (Linux), "
                           f"which could not be written: {error}") from None


def format_markdown(result: dict) -> str:
    opts = result["options"]
    gib = 2**30
    lines = [f"LM head loss step, {opts['tokens']:,} tokens x {opts['vocab_size']:,} vocabulary, hidden "
             f"{opts['hidden_size']}, {opts['dtype']}, {opts['threads']} thread(s); the fp32 logits are "
             f"{result['fp32_logits_bytes'] / gib:.2f} GiB",
             "",
             "| path | peak above the inputs (GiB) | step (s) | step CPU time (s) | loss |",
             "|---|---:|---:|---:|---:|"]
    for row in result["rows"]:
        name = "whole logits" if row["path"] == "whole" else f"chunked ({opts['chunk_tokens']} tokens)"
        lines.append(f"| {name} | {row['peak_bytes'] / gib:.3f} | {row['step_s']:.2f} | {row['step_cpu_s']:.2f} | {row['loss']:.6f} |")
    lines += ["",
              f"chunked peak / fp32 logits: {result['chunked_peak_of_logits']:.3f} (1/4 = 0.25); "
              f"chunked peak / whole peak: {result['chunked_peak_of_whole_peak']:.3f}; "
              f"chunked CPU time / whole CPU time: {result['chunked_cpu_time_of_whole']:.2f}"]
    return "\n".join(lines) + "\n"
