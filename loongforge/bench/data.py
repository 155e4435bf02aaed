"""``loongforge bench data``: what reading the data costs each rank before the first step, at
100k to 10M samples, for the memory-mapped reader against the in-memory one.

Inputs are generated: JSON lines of real chats from the shared data (COCO captions with one image,
MathVista questions with one image, arena-hard prompts with long answers, alpaca instructions),
drawn in a fixed random order, each image a path to one of the real COCO photos; so text lengths,
image counts and line sizes follow real data, and images are real files.

For each reader and size, ``--dp`` rank processes (spawned fresh, so each one's peak RSS is its
own) start together and each: loads the preset's config and tokenizer, opens the reader, builds a
``DataPipeline`` (data.read=global: every rank indexes every sample, as ranks do to agree on the
global row stream) and takes its first step (packing, tokenizing, and decoding its rows' images).
Reported per configuration: time from launch to the first step (slowest rank), peak RSS (largest
rank), and for the Arrow reader the copy's build time and size (cold: empty cache; warm: built).
Random-access read speed (``get`` of random indices, one process) is measured per reader.
Both readers' first steps are checked to hold the same samples in the same order.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from tqdm import tqdm

from loongforge.bench.data_probe import open_reader, peak_rss, reader_main
from loongforge.bench.chat_sets import chat_record, chat_sets
from loongforge.bench.datasets import COCO_IMAGES, Chat
from loongforge.bench.plots import save_figure, subplots
from loongforge.bench.processes import run_spawned
from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.data.pipeline import DataPipeline
from loongforge.data.tokenizer import load_tokenizer

READERS = ("in-memory", "arrow")
_READ_PROBES = 20_000


@dataclass
class DataBenchRow:
    """DP rank processes started together, up to their first step."""

    reader: str  # "in-memory" or "arrow"
    cache: str  # "cold", "warm" (arrow) or "-" (in-memory)
    samples: int
    input_bytes: int
    first_step_s: float  # launch -> first step returned, slowest rank
    open_s: float  # opening the reader (the Arrow copy's build on a cold cache), slowest rank
    peak_rss_bytes: int  # largest rank
    private_bytes: int  # largest rank's anonymous (not file-backed) resident memory at its first step
    cache_bytes: int  # size of the Arrow copy (0 for in-memory)
    first_step_ids: list  # rank 0's first step's sample ids, per micro-batch


@dataclass
class ReaderRow:
    """The reader alone in one process (no tokenizer, no model): open it, read random samples."""

    reader: str
    samples: int
    open_s: float
    reads_per_s: float
    peak_rss_bytes: int


@dataclass
class DataBench:
    preset: str
    dp: int
    global_batch_size: int
    rows: list[DataBenchRow]
    reader_rows: list[ReaderRow]


# ---------------------------------------------------------------- inputs


def chat_pool(root: Path) -> list[Chat]:
    """The real chats, in a fixed random order."""
    pool = [chat for chats in chat_sets(root).values() for chat in chats]
    return [pool[i] for i in np.random.default_rng(0).permutation(len(pool))]


def write_inputs(path: Path, num_samples: int, root: Path) -> int:
    """``num_samples`` JSON lines cycling through the pool; returns the bytes written."""
    images = [str(p) for p in sorted((root / COCO_IMAGES).glob("*.jpg"))]
    if not images:
        raise InputError(f"--data-root {root}: no JPEG under {COCO_IMAGES}")
    templates = [_line_template(chat) for chat in chat_pool(root)]
    written = 0
    with open(path, "w", encoding="utf-8") as f, tqdm(total=num_samples, desc=f"writing {path.name}",
                                                       unit=" samples", unit_scale=True, leave=False) as bar:
        for start in range(0, num_samples, 100_000):
            chunk = []
            for k in range(start, min(start + 100_000, num_samples)):
                template, image_count = templates[k % len(templates)]
                chunk.append(template.replace("@IMAGES@", json.dumps(
                    [images[(k + j) % len(images)] for j in range(image_count)])))
            text = "".join(chunk)
            f.write(text)
            written += len(text.encode())
            bar.update(len(chunk))
    return written


def _line_template(chat: Chat) -> tuple[str, int]:
    return json.dumps(chat_record(chat, "@IMAGES@"), ensure_ascii=False).replace('"@IMAGES@"', "@IMAGES@") + "\n", len(chat.image_sizes)


# ---------------------------------------------------------------- measuring processes


def _rank_main(queue, reader: str, data: str, cache: str, preset: str, dp_rank: int, dp: int, gbs: int,
               launched: float) -> None:
    cfg = load_run_config(preset, overrides=["data.source=files", f"data.paths=[{data}]", "data.read=global",
                                             f"data.cache_dir={cache}", "data.num_workers=0",
                                             f"training.global_batch_size={gbs}"])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    start = time.time()
    samples = open_reader(reader, data, cache)
    open_s = time.time() - start
    pipeline = DataPipeline(cfg.data, cfg.model, global_batch_size=gbs, dp_rank=dp_rank, dp_size=dp,
                            pad_to_multiple=64, tokenizer=tokenizer, samples=samples)
    step = pipeline.next_step()
    first_step_s = time.time() - launched
    queue.put({"rank": dp_rank, "open_s": open_s, "first_step_s": first_step_s, "peak_rss_bytes": peak_rss(),
               "private_bytes": _private_bytes(), "ids": [mb["sample_ids"] for mb in step]})


def _private_bytes() -> int:
    """Anonymous resident memory (Linux ``RssAnon``): what the process holds beyond mapped files."""
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _launch(reader: str, data: Path, cache: Path, preset: str, dp: int, gbs: int, start_method: str) -> list[dict]:
    launched = time.time()
    results = run_spawned(_rank_main, [(reader, str(data), str(cache), preset, r, dp, gbs, launched) for r in range(dp)],
                          what="bench data", start_method=start_method)
    return sorted(results, key=lambda r: r["rank"])


# ---------------------------------------------------------------- the benchmark


def run_data_bench(root: Path, work: Path, *, sizes: tuple[int, ...], baseline_max: int, preset: str, dp: int,
                   global_batch_size: int, on_progress: Optional[Callable[[str], None]] = None,
                   start_method: str = "spawn") -> DataBench:
    """``baseline_max``: the largest size the in-memory reader is run at (it needs RAM ~ the data).
    ``start_method``: how the measuring processes start (``run_spawned``'s test hook)."""
    say = on_progress or (lambda message: None)
    bench = DataBench(preset=preset, dp=dp, global_batch_size=global_batch_size, rows=[], reader_rows=[])
    work.mkdir(parents=True, exist_ok=True)
    for size in sizes:
        data, cache = work / f"chats_{size}.jsonl", work / f"cache_{size}"
        say(f"writing {size:,} samples")
        input_bytes = write_inputs(data, size, root)
        baseline = size <= baseline_max
        for reader, state in [("arrow", "cold"), ("arrow", "warm")] + [("in-memory", "-")] * baseline:
            say(f"{reader} reader{'' if state == '-' else f', {state} cache'}, {size:,} samples, {dp} ranks")
            results = _launch(reader, data, cache, preset, dp, global_batch_size, start_method)
            bench.rows.append(DataBenchRow(
                reader=reader, cache=state, samples=size, input_bytes=input_bytes,
                first_step_s=max(r["first_step_s"] for r in results), open_s=max(r["open_s"] for r in results),
                peak_rss_bytes=max(r["peak_rss_bytes"] for r in results),
                private_bytes=max(r["private_bytes"] for r in results),
                cache_bytes=sum(p.stat().st_size for p in cache.rglob("*.arrow")) if reader == "arrow" else 0,
                first_step_ids=results[0]["ids"]))
        _check_same_first_steps([r for r in bench.rows if r.samples == size])
        for reader in ["arrow"] + ["in-memory"] * baseline:
            say(f"{reader} reader alone, {size:,} samples, {_READ_PROBES:,} random reads")
            (result,) = run_spawned(reader_main, [(reader, str(data), str(cache), _READ_PROBES)], what="bench data",
                                    start_method=start_method)
            bench.reader_rows.append(ReaderRow(reader=reader, samples=size, **result))
        data.unlink()
        shutil.rmtree(cache, ignore_errors=True)
    return bench


def _check_same_first_steps(rows: list[DataBenchRow]) -> None:
    reference = rows[0]
    for row in rows[1:]:
        if row.first_step_ids != reference.first_step_ids:
            raise RuntimeError(f"bench data: the {row.reader} reader's first step at {row.samples} samples holds "
                               f"other samples than the {reference.reader} reader's")


# ---------------------------------------------------------------- reporting


def format_table(bench: DataBench) -> str:
    lines = ["| samples | input MiB | reader | cache | time to first step s | reader open s | peak RSS per rank GiB | "
             "private GiB | Arrow copy MiB |", "|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in bench.rows:
        copy = f"{r.cache_bytes / 2**20:,.0f}" if r.cache_bytes else "-"
        lines.append(f"| {r.samples:,} | {r.input_bytes / 2**20:,.0f} | {r.reader} | {r.cache} | "
                     f"{r.first_step_s:.1f} | {r.open_s:.1f} | {r.peak_rss_bytes / 2**30:.2f} | "
                     f"{r.private_bytes / 2**30:.2f} | {copy} |")
    return "\n".join(lines)


def format_reader_table(bench: DataBench) -> str:
    lines = ["| samples | reader | open s | random reads/s | peak RSS MiB |", "|---:|---|---:|---:|---:|"]
    lines += [f"| {r.samples:,} | {r.reader} | {r.open_s:.2f} | {r.reads_per_s:,.0f} | {r.peak_rss_bytes / 2**20:,.0f} |"
              for r in bench.reader_rows]
    return "\n".join(lines)


def ratios(bench: DataBench) -> dict[str, float]:
    """The acceptance ratios, where the run has the sizes they need."""
    warm = {r.samples: r for r in bench.rows if r.reader == "arrow" and r.cache == "warm"}
    before = {r.samples: r for r in bench.rows if r.reader == "in-memory"}
    alone = {(r.reader, r.samples): r for r in bench.reader_rows}
    out = {}
    if warm:
        smallest, largest = min(warm), max(warm)
        out[f"Arrow, peak RSS per rank at {largest:,} / at {smallest:,}"] = (
            warm[largest].peak_rss_bytes / warm[smallest].peak_rss_bytes)
        out[f"Arrow, time to first step on a warm cache at {largest:,} (s)"] = warm[largest].first_step_s
    for size in sorted(set(before) & set(warm)):
        out[f"in-memory / Arrow, peak RSS per rank at {size:,}"] = before[size].peak_rss_bytes / warm[size].peak_rss_bytes
        if ("in-memory", size) in alone and ("arrow", size) in alone:
            out[f"in-memory / Arrow, peak RSS of the reader alone at {size:,}"] = (
                alone["in-memory", size].peak_rss_bytes / alone["arrow", size].peak_rss_bytes)
    return out


def report(bench: DataBench, plot_name: str, command: str) -> str:
    lines = [
        "# Data reader at scale", "",
        f"Generated by `{command}` (CPU, 2 cores). Preset {bench.preset}, {bench.dp} rank processes, a first "
        f"step of {bench.global_batch_size} rows; inputs are generated JSON lines of real chats (see "
        "`loongforge/bench/data.py`). The in-memory reader is the one runs used before the Arrow reader.", "",
        "Ranks, launch to first step (peak RSS includes the pages of the mapped Arrow copy a rank has "
        "mapped; private is its anonymous memory at the first step):", "",
        format_table(bench), "",
        f"The reader alone (one process, no tokenizer or model: open, then {_READ_PROBES:,} random reads):", "",
        format_reader_table(bench), "",
        "Ratios measured in this run:", "",
        *[f"- {name}: {value:.2f}" for name, value in ratios(bench).items()], "",
        "Both readers' first steps hold the same samples in the same order (checked by the benchmark).", "",
        f"![peak RSS and time to first step]({plot_name})", "",
    ]
    return "\n".join(lines)


def plot(bench: DataBench, path: Path) -> None:
    fig, axes = subplots(1, 2, figsize=(11, 4.2))
    series = [("in-memory", "-", "in-memory reader"), ("arrow", "cold", "Arrow, cold cache"),
              ("arrow", "warm", "Arrow, warm cache")]
    for reader, cache, label in series:
        rows = [r for r in bench.rows if r.reader == reader and r.cache == cache]
        if not rows:
            continue
        sizes = [r.samples for r in rows]
        axes[0].plot(sizes, [r.peak_rss_bytes / 2**30 for r in rows], marker="o", label=label)
        axes[1].plot(sizes, [r.first_step_s for r in rows], marker="o", label=label)
    for ax, title in zip(axes, ("peak RSS per rank (GiB)", "time to first step (s)")):
        ax.set_xscale("log")
        ax.set_xlabel("samples")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path)
