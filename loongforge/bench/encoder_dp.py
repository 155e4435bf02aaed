"""``loongforge bench encoder-dp``: what ``parallel.encoder_dp`` saves, measured in real training.

For each layout (TP2: 2 processes; TP2 x PP2: 4) and each mode, one ``loongforge train`` run of
the encoder-heavy ``qwen2.5vl-tiny-vit`` preset, every run on the same samples: COCO val2017
photos (the real files, at the preset's 448 x 448 pixel limit), ``images_per_sample`` to a caption
chat, packed so that each micro-batch holds several images. Every mode runs at vision TP 1 (a
whole encoder on each rank): ``none`` encodes every image on every rank of a TP group, ``tp``
divides them.

Read from each run's ``metrics.jsonl`` (``train.runner.RANK_MEASURES``), means over the steps after
the warm-up: each rank's encoder forward+backward time (``profile.encoder_clock``; CPU seconds, the
process's own work, and wall), the step time (rank 0's wall ``train_step``) and each rank's step CPU
time, and each rank's peak memory (resident-set high water). Ratios are against ``none`` in the
same layout. The slowest encoder rank is what a step waits for, so its ratio is the headline.

On a shared CPU the wall clock counts other processes' time as well; the CPU clock does not,
which is why the encoder and step CPU columns are the comparable ones across runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from loongforge.bench.datasets import COCO_CAPTIONS, COCO_IMAGES
from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.config.validate import CHOICES
from loongforge.train import launch
from loongforge.train.metrics import METRICS_FILE, read_metrics

PRESET = "qwen2.5vl-tiny-vit"
DEFAULT_MODES = ("none", "tp")
# name -> (tensor parallel, pipeline parallel); the process count is their product (DP 1).
LAYOUTS = {"tp2": (2, 1), "tp2pp2": (2, 2)}
DEFAULT_LAYOUTS = ("tp2", "tp2pp2")
REQUIRED = (COCO_CAPTIONS, COCO_IMAGES)
DATA_FILE = "coco_chats.json"


def valid_modes(modes: Sequence[str]) -> list[str]:
    """``modes`` if the config validator accepts each (``none`` first, the baseline); else InputError."""
    accepted = CHOICES["parallel.encoder_dp"]
    unknown = [mode for mode in modes if mode not in accepted]
    if unknown or not modes:
        raise InputError(f"--modes {','.join(modes)}: expected some of {' | '.join(accepted)}")
    return ["none", *(mode for mode in modes if mode != "none")]


def layout_label(layout: str) -> str:
    tp, pp = LAYOUTS[layout]
    return f"TP{tp}" + (f" x PP{pp}" if pp > 1 else "") + f" ({tp * pp} processes)"


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


@dataclass(frozen=True)
class BenchSettings:
    steps: int = 4
    warmup_steps: int = 1
    images_per_sample: int = 2
    # Two 2-image chats (~500 tokens each at 448 x 448) fill a row: four images per micro-batch.
    seq_len: int = 1152
    micro_batches: int = 2  # per step (the global batch at DP 1): PP 2 runs a real 1F1B schedule
    # Runs per (layout, mode), in mirrored order (none, tp, then tp, none): on a machine whose speed
    # drifts with other jobs' load, each mode gets the early and the late slots alike.
    repeats: int = 1


def run_order(layouts: Sequence[str], modes: Sequence[str], repeats: int) -> list[tuple[str, str, int]]:
    """(layout, mode, repeat) in the order they train: per layout, the modes forward on even
    repeats and backward on odd ones."""
    return [(layout, mode, r) for layout in layouts for r in range(repeats)
            for mode in (modes if r % 2 == 0 else modes[::-1])]


def run_overrides(layout: str, mode: str, data_file: Path, out_dir: Path, settings: BenchSettings) -> list[str]:
    tp, pp = LAYOUTS[layout]
    return [f"parallel.world_size={tp * pp}", f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}", "parallel.vision_tensor_model_parallel_size=1",
            f"parallel.encoder_dp={mode}", "data.source=files", f"data.paths=[{data_file}]",
            f"data.seq_len={settings.seq_len}", f"training.global_batch_size={settings.micro_batches}",
            f"training.train_steps={settings.steps}", f"logging.output_dir={out_dir}",
            f"logging.log_interval={settings.steps}", "logging.progress_bar=false",
            "logging.tensorboard=false", "checkpoint.save_at_end=false", "checkpoint.save_interval=0"]


def train_run(layout: str, mode: str, data_file: Path, out_dir: Path, settings: BenchSettings,
              command_line: Sequence[str]) -> None:
    """One real training run (spawned workers, as ``loongforge train --nproc-per-node``)."""
    tp, pp = LAYOUTS[layout]
    cfg = load_run_config(PRESET, world_size=tp * pp,
                          overrides=run_overrides(layout, mode, data_file, out_dir, settings))
    launch.launch_local_workers(cfg, nproc_per_node=tp * pp, resume=False, command_line=list(command_line))


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
    """One run against ``none`` in the same layout (ratios: this run / none)."""

    run: RunMeasure
    encoder_ratio: float  # slowest encoder rank's CPU time
    mean_encoder_ratio: float  # mean over encoder ranks
    step_ratio: float  # wall step time
    step_cpu_ratio: float  # slowest rank's step CPU time
    memory_ratio: float  # largest per-rank peak memory

    def to_dict(self) -> dict:
        return {**asdict(self.run), **{k: v for k, v in asdict(self).items() if k != "run"}}


def compare(runs: Sequence[RunMeasure]) -> list[Comparison]:
    """Every run against the ``none`` run of its layout (which compares to itself: ratios 1)."""
    baselines = {run.layout: run for run in runs if run.mode == "none"}
    missing = sorted({run.layout for run in runs} - set(baselines))
    if missing:
        raise ValueError(f"no encoder_dp=none run for layout(s) {missing}: it is the baseline")
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


def format_table(comparisons: Sequence[Comparison]) -> str:
    rows = ["| layout | encoder_dp | encoder CPU s per rank | encoder vs none (slowest / mean rank) | "
            "encoder wall s per rank | step s (wall) | step vs none | step CPU s per rank | "
            "step CPU vs none | peak memory MiB per rank | memory vs none |",
            "|---|---|---|---|---|---:|---:|---|---:|---|---:|"]
    for c in comparisons:
        run = c.run
        rows.append(f"| {layout_label(run.layout)} | {run.mode} | {_cells(run.encoder_cpu_s, '.2f')} | "
                    f"{c.encoder_ratio:.2f} / {c.mean_encoder_ratio:.2f} | {_cells(run.encoder_s, '.2f')} | "
                    f"{run.step_s:.2f} | {c.step_ratio:.2f} | {_cells(run.step_cpu_s, '.2f')} | "
                    f"{c.step_cpu_ratio:.2f} | {_cells(run.peak_memory_mib, '.0f')} | {c.memory_ratio:.2f} |")
    return "\n".join(rows)


def summary_lines(comparisons: Sequence[Comparison]) -> list[str]:
    return [f"{layout_label(c.run.layout)}: encoder_dp={c.run.mode} encoder time (slowest rank) "
            f"{c.encoder_ratio:.2f}x none, step {c.step_ratio:.2f}x (CPU {c.step_cpu_ratio:.2f}x), "
            f"peak memory {c.memory_ratio:.2f}x" for c in comparisons if c.run.mode != "none"]


def plot(comparisons: Sequence[Comparison], path: Path) -> None:
    """Per-rank encoder CPU time per step, one group of bars per (layout, mode)."""
    import matplotlib  # lazy: only plotting needs matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot takes its backend on import

    fig, ax = plt.subplots(figsize=(2.2 * len(comparisons) + 2, 4))
    labelled = set()
    for k, c in enumerate(comparisons):
        ranks = [(rank, v) for rank, v in enumerate(c.run.encoder_cpu_s) if v is not None]  # encoder ranks only
        width = 0.8 / len(ranks)
        for slot, (rank, value) in enumerate(ranks):
            ax.bar(k + (slot - (len(ranks) - 1) / 2) * width, value, width, color=f"C{rank}",
                   label=None if rank in labelled else f"rank {rank}")
            labelled.add(rank)
    ax.set_xticks(range(len(comparisons)),
                  [f"{layout_label(c.run.layout).split(' (')[0]}\n{c.run.mode} ({c.encoder_ratio:.2f}x)"
                   for c in comparisons])
    ax.set_ylabel("encoder forward+backward CPU s per step")
    ax.set_title(f"{PRESET}: encoder time per rank (vs none, slowest rank)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------ the bench


@dataclass
class EncoderDpBench:
    comparisons: list
    settings: BenchSettings
    table: str

    def to_dict(self) -> dict:
        return {"preset": PRESET, "settings": asdict(self.settings),
                "runs": [c.to_dict() for c in self.comparisons]}


def run_encoder_dp_bench(out: Path, data_root: Path, *, modes: Sequence[str] = DEFAULT_MODES,
                         layouts: Sequence[str] = DEFAULT_LAYOUTS, settings: BenchSettings = BenchSettings(),
                         report_only: bool = False, command_line: Sequence[str] = (),
                         progress: Optional[Callable[[str], None]] = None) -> EncoderDpBench:
    """Train (or, with ``report_only``, reread) every (layout, mode) run under ``out``; write
    encoder_dp.md, encoder_dp.json and encoder_dp.png there."""
    modes = valid_modes(modes)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data_file = out / DATA_FILE
    if not report_only:
        chats = coco_chats(data_root, settings.images_per_sample, 4 * settings.steps * settings.micro_batches)
        data_file.write_text(json.dumps(chats, indent=1))
    records: dict[tuple[str, str], list] = {}
    order = run_order(layouts, modes, settings.repeats)
    for layout, mode, repeat in tqdm(order, desc="encoder-dp runs", unit="run", disable=report_only):
        run_dir = out / layout / mode / f"run{repeat}"
        if not report_only:
            if progress is not None:
                progress(f"training {settings.steps} steps: {layout_label(layout)}, encoder_dp={mode}, "
                         f"run {repeat + 1} of {settings.repeats}")
            train_run(layout, mode, data_file, run_dir, settings, command_line)
        records.setdefault((layout, mode), []).extend(run_metrics(run_dir))
    comparisons = compare([measure_run(layout, mode, lines, settings.warmup_steps)
                           for (layout, mode), lines in records.items()])
    bench = EncoderDpBench(comparisons=comparisons, settings=settings, table=format_table(comparisons))
    plot(comparisons, out / "encoder_dp.png")
    (out / "encoder_dp.json").write_text(json.dumps(bench.to_dict(), indent=2) + "\n")
    (out / "encoder_dp.md").write_text(f"```\n{' '.join(command_line)}\n```\n\n{bench.table}\n\n"
                                       + "\n".join(summary_lines(comparisons))
                                       + "\n\n![encoder time per rank](encoder_dp.png)\n")
    return bench
