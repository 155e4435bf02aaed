"""``loongforge bench pack``: fill ratio of the packing algorithms on real data, plan and scan speed.

Sets (read under ``--data-root`` by ``loongforge.bench.datasets``; every sample's LLM length is
exact, sized by its ``SampleSizer`` as ``pack`` measures it, each image from its recorded
width x height, so no image file is needed):

- ``coco``: COCO val2017 captions, one "describe" chat per caption, image sizes from the json;
- ``mathvista``: MathVista testmini question (+ choices) -> answer, image sizes from its metadata;
- ``arena_hard``: arena-hard v2.0 prompts with o3-mini answers (long-tail text);
- ``alpaca``: LLaMA-Factory's alpaca_en demo (short chat);
- ``mixed``: all of the above, interleaved in a fixed random order.

Samples longer than ``seq_len`` are dropped and counted (``pack`` rejects them as too_long).
Every algorithm packs the same samples in the same run; "bound" is the best fill any algorithm
could reach, tokens / (ceil(tokens / seq_len) x seq_len).

Plan speed: the plan stage's algorithms on 1,000,000 lengths drawn from the mixed set. Scan speed:
the real scan stage (read, tokenize, read image headers) on COCO chats that point at the 50 COCO
images under the data root, with 1 and 2 worker processes.
"""

from __future__ import annotations

import json
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from loongforge.bench.chat_sets import chat_record, chat_sets
from loongforge.bench.datasets import COCO_CAPTIONS, COCO_IMAGES, Chat, SampleSizer, coco_chats
from loongforge.bench.plots import save_figure, subplots
from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.samples import Reject
from loongforge.pack import workers
from loongforge.pack.algorithms import ALGORITHMS, BASELINES, fill_ratio, plan_packs, quadratic_costs
from loongforge.pack.scan import run_scan

SEQ_LENS = (8192, 32768)
BENCH_ALGORITHMS = ALGORITHMS + BASELINES
SETS = ("coco", "mathvista", "arena_hard", "alpaca", "mixed")


@dataclass
class PackBench:
    preset: str
    set_sizes: dict[str, int]
    lengths: dict[str, np.ndarray]
    rows: list[dict]
    plan_rows: list[dict]
    scan_rows: list[dict]


# ---------------------------------------------------------------- the real sets


def mixed_lengths(lengths: dict[str, np.ndarray]) -> np.ndarray:
    """Every set's samples, interleaved in a fixed random order."""
    everything = np.concatenate([lengths[name] for name in SETS[:-1]])
    return everything[np.random.default_rng(0).permutation(len(everything))]


def chat_lengths(sizer: SampleSizer, chats: list[Chat], name: str) -> np.ndarray:
    """LLM tokens of each chat as ``pack`` measures them; InputError if one would be rejected."""
    lengths = np.empty(len(chats), dtype=np.int64)
    for k, size in enumerate(sizer.size_chats(chats, name)):
        if isinstance(size, Reject):
            raise InputError(f"{name} sample {k}: {size.reason} ({size.detail})")
        lengths[k] = size.tokens
    return lengths


# ---------------------------------------------------------------- the benchmark


def fill_rows(name: str, lengths: np.ndarray, seq_len: int) -> list[dict]:
    kept = lengths[lengths <= seq_len]
    total = int(kept.sum())
    bound = total / (-(-total // seq_len) * seq_len) if total else 0.0
    rows = []
    for algorithm in BENCH_ALGORITHMS:
        start = time.perf_counter()
        packs = plan_packs(kept, seq_len, algorithm)
        seconds = time.perf_counter() - start
        costs = quadratic_costs(packs, kept)
        rows.append({"set": name, "seq_len": seq_len, "samples": int(len(kept)),
                     "too_long": int(len(lengths) - len(kept)), "algorithm": algorithm, "packs": len(packs),
                     "fill": fill_ratio(packs, kept, seq_len), "bound": bound,
                     "cost_cv": float(costs.std() / costs.mean()), "plan_s": seconds})
    return rows


def plan_speed_rows(pool: np.ndarray, num_samples: int, seq_len: int = 8192) -> list[dict]:
    lengths = np.random.default_rng(0).choice(pool[pool <= seq_len], size=num_samples, replace=True)
    rows = []
    for algorithm in ALGORITHMS:
        start, cpu_start = time.perf_counter(), time.process_time()
        packs = plan_packs(lengths, seq_len, algorithm)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        rows.append({"algorithm": algorithm, "samples": num_samples, "seq_len": seq_len, "seconds": seconds,
                     "cpu_s": cpu_seconds, "samples_per_s": num_samples / seconds,
                     "fill": fill_ratio(packs, lengths, seq_len)})
    return rows


def scan_speed_rows(root: Path, preset: str, num_samples: int, worker_counts: tuple[int, ...]) -> list[dict]:
    """The scan stage proper (ArrowSamples already mapped, tokenizer already loaded) on real JPEGs."""
    images = sorted((root / COCO_IMAGES).glob("*.jpg"))
    captions = coco_chats(root / COCO_CAPTIONS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "coco_chats.jsonl"
        with open(data, "w") as f:
            for k in range(num_samples):
                chat = captions[k % len(captions)]
                f.write(json.dumps(chat_record(chat, [str(images[k % len(images)])])) + "\n")
        cfg = load_run_config(preset, overrides=["data.seq_len=32768"])
        samples = ArrowSamples([str(data)], str(Path(tmp) / "arrow"))
        context = workers.MeasureContext(inputs=(str(data),), data_cfg=cfg.data, model_cfg=cfg.model)
        workers.install(context, samples)
        workers.measurer()
        for count in worker_counts:
            out = Path(tmp) / f"scan_{count}"
            start, cpu_start = time.perf_counter(), _cpu_seconds()
            run_scan(out, len(samples), context, num_workers=count)
            seconds, cpu_seconds = time.perf_counter() - start, _cpu_seconds() - cpu_start
            rows.append({"workers": count, "samples": len(samples), "seconds": seconds, "cpu_s": cpu_seconds,
                         "samples_per_s": len(samples) / seconds,
                         "samples_per_s_per_worker": len(samples) / seconds / count,
                         "samples_per_cpu_s": len(samples) / cpu_seconds})
    return rows


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (scan workers): on a shared machine
    wall time says more about the neighbours than about the code."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_pack_bench(root: Path, *, preset: str, seq_lens: tuple[int, ...] = SEQ_LENS,
                   plan_samples: int = 1_000_000, scan_samples: int = 4000,
                   scan_workers: tuple[int, ...] = (1, 2),
                   on_progress: Optional[Callable[[str], None]] = None) -> PackBench:
    say = on_progress or (lambda message: None)
    say("reading and sizing the sets")
    chats = chat_sets(root)  # all of SETS but mixed, which mixed_lengths makes from them
    sizer = SampleSizer(preset)
    lengths = {name: chat_lengths(sizer, chats[name], name) for name in SETS[:-1]}
    lengths["mixed"] = mixed_lengths(lengths)
    rows = []
    for seq_len in seq_lens:
        for name in SETS:
            say(f"packing {name} at seq_len {seq_len}")
            rows.extend(fill_rows(name, lengths[name], seq_len))
    say(f"planning {plan_samples} samples")
    plan_rows = plan_speed_rows(lengths["mixed"], plan_samples)
    say(f"scanning {scan_samples} COCO chats")
    scan_rows = scan_speed_rows(root, preset, scan_samples, scan_workers)
    return PackBench(preset=preset, set_sizes={k: len(v) for k, v in lengths.items()}, lengths=lengths, rows=rows,
                     plan_rows=plan_rows, scan_rows=scan_rows)


# ---------------------------------------------------------------- reporting


def format_fill_table(rows: list[dict]) -> str:
    lines = ["| set | seq_len | samples (too long) | bound | " + " | ".join(BENCH_ALGORITHMS) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(BENCH_ALGORITHMS)]
    keys = sorted({(r["seq_len"], SETS.index(r["set"])) for r in rows})
    for seq_len, set_index in keys:
        group = {r["algorithm"]: r for r in rows if r["seq_len"] == seq_len and r["set"] == SETS[set_index]}
        first = next(iter(group.values()))
        cells = [f"{group[a]['fill']:.2%} ({group[a]['packs']})" for a in BENCH_ALGORITHMS]
        lines.append(f"| {first['set']} | {seq_len} | {first['samples']} ({first['too_long']}) | "
                     f"{first['bound']:.2%} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_cost_table(rows: list[dict]) -> str:
    lines = ["| set | seq_len | " + " | ".join(BENCH_ALGORITHMS) + " |", "|---|---:|" + "---:|" * len(BENCH_ALGORITHMS)]
    keys = sorted({(r["seq_len"], SETS.index(r["set"])) for r in rows})
    for seq_len, set_index in keys:
        group = {r["algorithm"]: r for r in rows if r["seq_len"] == seq_len and r["set"] == SETS[set_index]}
        lines.append(f"| {SETS[set_index]} | {seq_len} | "
                     + " | ".join(f"{group[a]['cost_cv']:.3f}" for a in BENCH_ALGORITHMS) + " |")
    return "\n".join(lines)


def format_speed_tables(bench: PackBench) -> str:
    plan = ["| algorithm | samples | seq_len | wall s | CPU s | samples/s (wall) | samples/CPU-s | fill |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    plan += [f"| {r['algorithm']} | {r['samples']:,} | {r['seq_len']} | {r['seconds']:.2f} | {r['cpu_s']:.2f} | "
             f"{r['samples_per_s']:,.0f} | {r['samples'] / r['cpu_s']:,.0f} | {r['fill']:.4%} |"
             for r in bench.plan_rows]
    scan = ["| workers | samples | wall s | CPU s | samples/s (wall) | samples/s per worker (wall) | samples/CPU-s |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    scan += [f"| {r['workers']} | {r['samples']} | {r['seconds']:.2f} | {r['cpu_s']:.2f} | {r['samples_per_s']:.0f} | "
             f"{r['samples_per_s_per_worker']:.0f} | {r['samples_per_cpu_s']:.0f} |" for r in bench.scan_rows]
    return "\n".join(plan) + "\n\n" + "\n".join(scan)


def plot(bench: PackBench, path: Path) -> None:
    seq_lens = sorted({r["seq_len"] for r in bench.rows})
    fig, axes = subplots(1, len(seq_lens) + 1, figsize=(6 * (len(seq_lens) + 1), 4.5))
    width = 0.8 / len(BENCH_ALGORITHMS)
    for ax, seq_len in zip(axes, seq_lens):
        for k, algorithm in enumerate(BENCH_ALGORITHMS):
            fills = [next(r["fill"] for r in bench.rows if r["seq_len"] == seq_len and r["set"] == name
                          and r["algorithm"] == algorithm) for name in SETS]
            ax.bar(np.arange(len(SETS)) + (k - (len(BENCH_ALGORITHMS) - 1) / 2) * width, fills, width,
                   label=algorithm)
        ax.axhline(0.99, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(np.arange(len(SETS)), SETS, rotation=20)
        ax.set_ylim(0.8, 1.005)
        ax.set_title(f"fill ratio at seq_len {seq_len}")
        ax.legend(fontsize=8, loc="lower left")
    ax = axes[-1]
    bins = np.logspace(1, np.log10(32768), 50)
    for name in SETS[:-1]:
        ax.hist(bench.lengths[name], bins=bins, histtype="step", label=name, density=True)
    ax.set_xscale("log")
    ax.set_title(f"sample LLM length ({bench.preset})")
    ax.set_xlabel("tokens")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def report(bench: PackBench, png_name: str) -> str:
    sizes = ", ".join(f"{k} {v:,}" for k, v in bench.set_sizes.items())
    return "\n".join([
        "# `loongforge bench pack`",
        "",
        f"Preset `{bench.preset}` (its tokenizer and image rules). Samples per set: {sizes}. "
        "Cells: fill ratio = real tokens / (packs x seq_len), packs in brackets; *bound* is the best any "
        "algorithm can reach with that many tokens (ceil(tokens / seq_len) packs). `first_fit` is first fit "
        "in arrival order, `knapsack` fills one pack at a time with the largest remaining sample that fits.",
        "",
        format_fill_table(bench.rows),
        "",
        "Spread of attention cost over packs (coefficient of variation of sum L^2 per pack; lower is "
        "more even):",
        "",
        format_cost_table(bench.rows),
        "",
        "Plan stage speed (lengths drawn from the mixed set) and scan stage speed (COCO chats over the 50 "
        "real JPEGs: read, tokenize, image headers):",
        "",
        format_speed_tables(bench),
        "",
        f"![fill ratio and length histogram]({png_name})",
        "",
    ])
