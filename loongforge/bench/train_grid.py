"""A grid of real training runs, process layouts x the modes of one option, shared by the benches of
encoder sharing: ``bench encoder-dp`` (``parallel.encoder_dp`` at TP2 and TP2 x PP2) and ``bench
context-parallel`` (``parallel.encoder_cp`` at CP 2 and CP 4).

Every run is one ``loongforge train`` of the encoder-heavy ``qwen2.5vl-tiny-vit`` preset, every run
on the same samples: COCO val2017 photos (the real files, at the preset's 448 x 448 pixel limit),
``images_per_sample`` to a caption chat, packed so that each row holds several chats, so many photos.
A bench names only what it varies (``TrainGrid``): its layouts with their settings, the overrides of
each mode and the baseline mode.

Read from each run's ``metrics.jsonl`` (``train.runner.RANK_MEASURES``), means over the steps after
the warm-up: each rank's encoder forward+backward time (``profile.encoder_clock``; CPU seconds, the
process's own work, and wall), the step time (rank 0's wall ``train_step``) and each rank's step CPU
time, and each rank's peak memory (resident-set high water). Ratios are against the baseline mode in
the same layout. The slowest encoder rank is what a step waits for, so its ratio is the headline.

On a shared CPU the wall clock counts other processes' time as well; the CPU clock does not,
which is why the encoder and step CPU columns are the comparable ones across runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean
from typing import Callable, Mapping, Optional, Sequence

from tqdm import tqdm

from loongforge.bench.datasets import COCO_CAPTIONS, COCO_IMAGES
from loongforge.bench.plots import save_figure, subplots
from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.models.registry import get_family
from loongforge.train import launch
from loongforge.train.metrics import METRICS_FILE, read_metrics

PRESET = "qwen2.5vl-tiny-vit"
REQUIRED = (COCO_CAPTIONS, COCO_IMAGES)
DATA_FILE = "coco_chats.json"


@dataclass(frozen=True)
class Layout:
    """One process layout of a grid, at DP 1."""

    name: str  # e.g. "TP2 x PP2"
    processes: int
    overrides: tuple  # the settings that make it (parallel.world_size among them)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.processes} processes)"


@dataclass(frozen=True)
class TrainGrid:
    """What a bench varies: ``mode_overrides(mode)`` in each of ``layouts``."""

    option: str  # the option the modes set, as the table names it (e.g. "encoder_dp")
    baseline: str  # the mode every other one is compared with, in its own layout
    layouts: Mapping[str, Layout]  # bench name of the layout (e.g. "tp2pp2") -> the layout
    mode_overrides: Callable[[str], list]  # mode -> its overrides


@dataclass(frozen=True)
class BenchSettings:
    steps: int = 4
    warmup_steps: int = 1
    images_per_sample: int = 2
    seq_len: int = 1152  # tokens per row: how many chats, so photos, share one
    micro_batches: int = 2  # per step (the global batch at DP 1)
    # Runs per (layout, mode), in mirrored order (baseline, others, then others, baseline): on a
    # machine whose speed drifts with other jobs' load, each mode gets the early and the late slots.
    repeats: int = 1


def run_order(layouts: Sequence[str], modes: Sequence[str], repeats: int) -> list[tuple[str, str, int]]:
    """(layout, mode, repeat) in the order they train: per layout, the modes forward on even
    repeats and backward on odd ones."""
    return [(layout, mode, r) for layout in layouts for r in range(repeats)
            for mode in (modes if r % 2 == 0 else modes[::-1])]


# ------------------------------------------------------------------------------------ data


def coco_chats(data_root: Path, images_per_sample: int, samples: int) -> list[dict]:
    """Caption chats over the COCO photos present under ``data_root``: sample k shows the next
    ``images_per_sample`` photos (in file-name order, cycling) and answers with their first
    captions. Absolute image paths, so the file may live anywhere."""
    captions = json.loads((data_root / COCO_CAPTIONS).read_text(encoding="utf-8"))
    image_ids = {image["file_name"]: image["id"] for image in captions["images"]}
    first_caption: dict[int, str] = {}
    for annotation in captions["annotations"]:
        first_caption.setdefault(annotation["image_id"], annotation["caption"].strip())
    photos = sorted(name for name in os.listdir(data_root / COCO_IMAGES) if name in image_ids)
    if not photos:
        raise InputError(f"--data-root {data_root}: no captioned photos in {COCO_IMAGES}")
    chats = []
    for k in range(samples):
        shown = [photos[(k * images_per_sample + i) % len(photos)] for i in range(images_per_sample)]
        chats.append({"messages": [
            {"role": "user", "content": "<image>" * len(shown) + "Describe these photos."},
            {"role": "assistant", "content": " ".join(first_caption[image_ids[p]] for p in shown)}],
            "images": [str((data_root / COCO_IMAGES / p).resolve()) for p in shown]})
    return chats


# ------------------------------------------------------------------------------------ runs


def run_overrides(grid: TrainGrid, layout: str, mode: str, data_file: Path, out_dir: Path,
                  settings: BenchSettings) -> list[str]:
    return [*grid.layouts[layout].overrides, *grid.mode_overrides(mode), "data.source=files",
            f"data.paths=[{data_file}]", f"data.seq_len={settings.seq_len}",
            f"training.global_batch_size={settings.micro_batches}", f"training.train_steps={settings.steps}",
            f"logging.output_dir={out_dir}", f"logging.log_interval={settings.steps}", "logging.progress_bar=false",
            "logging.tensorboard=false", "checkpoint.save_at_end=false", "checkpoint.save_interval=0"]


def train_run(processes: int, overrides: list[str], command_line: Sequence[str]) -> None:
    """One real training run (spawned workers, as ``loongforge train --nproc-per-node``)."""
    cfg = load_run_config(PRESET, world_size=processes, overrides=overrides)
    launch.launch_local_workers(cfg, nproc_per_node=processes, resume=False, command_line=list(command_line))


def run_metrics(out_dir: Path) -> list[dict]:
    path = out_dir / METRICS_FILE
    if not path.is_file():
        raise InputError(f"no {path}: run the bench without --report-only first")
    return read_metrics(path)


# ------------------------------------------------------------------------------------ figures


@dataclass
class RunMeasure:
    """One (layout, mode) run: means over the measured steps; per-rank lists in rank order, None
    for a rank without the encoder (a later pipeline stage)."""

    layout: str
    mode: str
    steps: int
    encoder_cpu_s: list  # per rank, forward+backward CPU seconds per step
    encoder_s: list  # per rank, wall
    step_s: float  # rank 0's wall train_step + data wait
    step_cpu_s: list  # per rank
    peak_memory_mib: list  # per rank, high water over the measured steps

    @property
    def max_encoder_cpu_s(self) -> float:
        return max(v for v in self.encoder_cpu_s if v is not None)

    @property
    def mean_encoder_cpu_s(self) -> float:
        return mean(v for v in self.encoder_cpu_s if v is not None)

    @property
    def slowest_encoder_share(self) -> float:
        """The encoder's part of the step CPU time on the rank with the most encoder time."""
        rank = max((v, r) for r, v in enumerate(self.encoder_cpu_s) if v is not None)[1]
        return self.encoder_cpu_s[rank] / self.step_cpu_s[rank]


def _per_rank_mean(records: list[dict], key: str) -> list:
    columns = list(zip(*(record[key] for record in records)))
    return [None if any(v is None for v in column) else mean(column) for column in columns]


def measure_run(layout: str, mode: str, records: list[dict], warmup_steps: int) -> RunMeasure:
    """``records``: the metrics lines of one run, or of several repeats of it one after another."""
    measured = [record for record in records if record["step"] > warmup_steps]
    if not measured:
        raise ValueError(f"{layout} {mode}: no step after the {warmup_steps} warm-up steps; raise --steps")
    if all(v is None for v in measured[0]["encoder_cpu_s_by_rank"]):
        raise ValueError(f"{layout} {mode}: no rank reported encoder time")
    return RunMeasure(layout=layout, mode=mode, steps=len(measured),
                      encoder_cpu_s=_per_rank_mean(measured, "encoder_cpu_s_by_rank"),
                      encoder_s=_per_rank_mean(measured, "encoder_s_by_rank"),
                      step_s=mean(record["step_s"] for record in measured),
                      step_cpu_s=_per_rank_mean(measured, "step_cpu_s_by_rank"),
                      peak_memory_mib=[max(column) for column in
                                       zip(*(record["peak_memory_mib_by_rank"] for record in measured))])


@dataclass
class Comparison:
    """One run against the baseline mode in the same layout (ratios: this run / baseline)."""

    run: RunMeasure
    encoder_ratio: float  # slowest encoder rank's CPU time
    mean_encoder_ratio: float  # mean over encoder ranks
    step_ratio: float  # wall step time
    step_cpu_ratio: float  # slowest rank's step CPU time
    memory_ratio: float  # largest per-rank peak memory

    def to_dict(self) -> dict:
        return {**asdict(self.run), **{k: v for k, v in asdict(self).items() if k != "run"}}


def compare(runs: Sequence[RunMeasure], grid: TrainGrid) -> list[Comparison]:
    """Every run against the baseline run of its layout (which compares to itself: ratios 1)."""
    baselines = {run.layout: run for run in runs if run.mode == grid.baseline}
    missing = sorted({run.layout for run in runs} - set(baselines))
    if missing:
        raise ValueError(f"no {grid.option}={grid.baseline} run for layout(s) {missing}: it is the baseline")
    comparisons = []
    for run in runs:
        base = baselines[run.layout]
        comparisons.append(Comparison(
            run=run, encoder_ratio=run.max_encoder_cpu_s / base.max_encoder_cpu_s,
            mean_encoder_ratio=run.mean_encoder_cpu_s / base.mean_encoder_cpu_s,
            step_ratio=run.step_s / base.step_s,
            step_cpu_ratio=max(run.step_cpu_s) / max(base.step_cpu_s),
            memory_ratio=max(run.peak_memory_mib) / max(base.peak_memory_mib)))
    return comparisons


def _cells(values: list, fmt: str) -> str:
    return " / ".join("-" if v is None else format(v, fmt) for v in values)


def format_table(comparisons: Sequence[Comparison], grid: TrainGrid) -> str:
    versus = f"vs {grid.baseline}"
    rows = [f"| layout | {grid.option} | encoder CPU s per rank | encoder {versus} (slowest / mean rank) | "
            f"encoder wall s per rank | step s (wall) | step {versus} | step CPU s per rank | "
            f"step CPU {versus} | peak memory MiB per rank | memory {versus} |",
            "|---|---|---|---|---|---:|---:|---|---:|---|---:|"]
    for c in comparisons:
        run = c.run
        rows.append(f"| {grid.layouts[run.layout].label} | {run.mode} | {_cells(run.encoder_cpu_s, '.2f')} | "
                    f"{c.encoder_ratio:.2f} / {c.mean_encoder_ratio:.2f} | {_cells(run.encoder_s, '.2f')} | "
                    f"{run.step_s:.2f} | {c.step_ratio:.2f} | {_cells(run.step_cpu_s, '.2f')} | "
                    f"{c.step_cpu_ratio:.2f} | {_cells(run.peak_memory_mib, '.0f')} | {c.memory_ratio:.2f} |")
    return "\n".join(rows)


def summary_lines(comparisons: Sequence[Comparison], grid: TrainGrid) -> list[str]:
    return [f"{grid.layouts[c.run.layout].label}: {grid.option}={c.run.mode} encoder time (slowest rank) "
            f"{c.encoder_ratio:.2f}x {grid.baseline}, step {c.step_ratio:.2f}x (CPU {c.step_cpu_ratio:.2f}x), "
            f"peak memory {c.memory_ratio:.2f}x" for c in comparisons if c.run.mode != grid.baseline]


def plot(comparisons: Sequence[Comparison], grid: TrainGrid, path: Path) -> None:
    """Per-rank encoder CPU time per step, one group of bars per (layout, mode)."""
    fig, ax = subplots(figsize=(2.2 * len(comparisons) + 2, 4))
    labelled = set()
    for k, c in enumerate(comparisons):
        ranks = [(rank, v) for rank, v in enumerate(c.run.encoder_cpu_s) if v is not None]  # encoder ranks only
        width = 0.8 / len(ranks)
        for slot, (rank, value) in enumerate(ranks):
            ax.bar(k + (slot - (len(ranks) - 1) / 2) * width, value, width, color=f"C{rank}",
                   label=None if rank in labelled else f"rank {rank}")
            labelled.add(rank)
    ax.set_xticks(range(len(comparisons)), [f"{grid.layouts[c.run.layout].name}\n{c.run.mode} ({c.encoder_ratio:.2f}x)"
                                            for c in comparisons])
    ax.set_ylabel("encoder forward+backward CPU s per step")
    ax.set_title(f"{PRESET}: encoder time per rank (vs {grid.baseline}, slowest rank)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


# ------------------------------------------------------------------------------------ the grid


@dataclass
class GridBench:
    comparisons: list
    settings: BenchSettings
    table: str

    @property
    def modes(self) -> list[str]:
        """The modes run, in run order (the baseline first)."""
        return list(dict.fromkeys(c.run.mode for c in self.comparisons))

    def comparison(self, layout: str, mode: str) -> Optional[Comparison]:
        return next((c for c in self.comparisons if (c.run.layout, c.run.mode) == (layout, mode)), None)

    def to_dict(self) -> dict:
        return {"preset": PRESET, "settings": asdict(self.settings),
                "runs": [c.to_dict() for c in self.comparisons]}


def _train_all(grid: TrainGrid, order: list, out: Path, data_root: Path, settings: BenchSettings,
               command_line: Sequence[str], progress: Optional[Callable[[str], None]]) -> None:
    data_file = out / DATA_FILE
    # Enough chats for every step's rows twice over (a row holds two or more).
    chats = coco_chats(data_root, settings.images_per_sample, 4 * settings.steps * settings.micro_batches)
    data_file.write_text(json.dumps(chats, indent=1))
    for layout, mode, repeat in tqdm(order, desc=f"{grid.option} runs", unit="run"):
        if progress is not None:
            progress(f"training {settings.steps} steps: {grid.layouts[layout].label}, {grid.option}={mode}, "
                     f"run {repeat + 1} of {settings.repeats}")
        overrides = run_overrides(grid, layout, mode, data_file, out / layout / mode / f"run{repeat}", settings)
        train_run(grid.layouts[layout].processes, overrides, command_line)


def run_grid(grid: TrainGrid, name: str, out: Path, data_root: Optional[Path], *, modes: Sequence[str],
             layouts: Sequence[str], settings: BenchSettings, report_only: bool = False,
             command_line: Sequence[str] = (), progress: Optional[Callable[[str], None]] = None) -> GridBench:
    """Train (or, with ``report_only``, reread) every (layout, mode) run under ``out``
    (``out/<layout>/<mode>/run<k>``); write ``name``.md, .json and .png there. ``modes``: the
    baseline first."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    order = run_order(layouts, modes, settings.repeats)
    if not report_only:
        _train_all(grid, order, out, data_root, settings, command_line, progress)
    records: dict[tuple[str, str], list] = {}
    for layout, mode, repeat in order:
        records.setdefault((layout, mode), []).extend(run_metrics(out / layout / mode / f"run{repeat}"))
    comparisons = compare([measure_run(layout, mode, lines, settings.warmup_steps)
                           for (layout, mode), lines in records.items()], grid)
    bench = GridBench(comparisons=comparisons, settings=settings, table=format_table(comparisons, grid))
    plot(comparisons, grid, out / f"{name}.png")
    (out / f"{name}.json").write_text(json.dumps(bench.to_dict(), indent=2) + "\n")
    (out / f"{name}.md").write_text(f"```\n{' '.join(command_line)}\n```\n\n{bench.table}\n\n"
                                    + "\n".join(summary_lines(comparisons, grid))
                                    + f"\n\n![encoder time per rank]({name}.png)\n")
    return bench


# ------------------------------------------------------------------------------------ reports


def _millions(count: int) -> str:
    return f"{count / 1e6:.1f}M"


def setup_lines(bench: GridBench, grid: TrainGrid) -> list[str]:
    """The report's description of the runs: model, data, steps and machine."""
    cfg = load_run_config(PRESET)
    counts = get_family(cfg.model.family).count_parameters(cfg.model)
    vision, language, s = cfg.model.vision, cfg.model.language, bench.settings
    mirrored = ", ".join([*bench.modes, *bench.modes[::-1]])
    return [
        f"- Preset `{PRESET}`: vision tower {vision.depth} x {vision.hidden_size} "
        f"({_millions(counts['vision_model'])} parameters) + merger ({_millions(counts['projector'])}) over a "
        f"{language.num_layers} x {language.hidden_size} language model ({_millions(counts['language_model'])}, "
        f"{_millions(language.vocab_size * language.hidden_size)} of it the embedding); fp32 on CPU.",
        f"- Data: the COCO val2017 photos of the shared data folder, {s.images_per_sample} per caption chat, "
        f"at most {cfg.data.max_pixels:,} pixels each (448 x 448; a 640 x 480 photo becomes 36 x 26 = 936 "
        f"patches); rows of {s.seq_len} tokens hold two chats, so each row carries "
        f"{2 * s.images_per_sample} photos; {s.micro_batches} micro-batch{'es' if s.micro_batches > 1 else ''} "
        "per step (DP 1).",
        f"- {s.steps} steps per run, the first {s.warmup_steps} left out; {s.repeats} run(s) per layout and "
        f"mode, in mirrored order ({mirrored}, ...), figures pooled over them; every run trains the "
        "same samples.",
        f"- Machine: {os.cpu_count()} CPU cores shared with other jobs, one torch thread per process, gloo. "
        "Encoder and step *CPU* seconds are each process's own work and do not count the other "
        "processes on the cores; the wall-clock columns do, so they are noisy here. The CPU clock is "
        "not fully immune either: with many processes on two cores (shared caches, context "
        "switches) the same work took up to ~30% more CPU seconds in one run than in another "
        "minutes apart, which is why the runs are mirrored and pooled.",
    ]


def measured_section(bench: GridBench, grid: TrainGrid, setup: Sequence[str]) -> list[str]:
    """A document's measured part: the runs described (``setup_lines`` and a bench's own ``setup``),
    the table, and what its columns are."""
    return [
        "## Measured: real training on CPU",
        "",
        "\n".join([*setup_lines(bench, grid), *setup]),
        "",
        bench.table,
        "",
        "Encoder times are the vision tower + merger forward and backward on each rank "
        "(`profile.encoder_clock`, logged per step as `encoder_cpu_s_by_rank` / `encoder_s_by_rank` "
        "in `metrics.jsonl`); `-` is a rank without the encoder (a later pipeline stage). Step "
        "time is rank 0's `train_step` (wall) and each rank's CPU seconds in it; peak memory is each "
        "process's resident-set high water (`peak_memory_mib_by_rank`). Ratios are against "
        f"`{grid.baseline}` in the same layout; the encoder ratio is the slowest encoder rank's (what the "
        "step waits for) / its mean over the encoder ranks.",
    ]
