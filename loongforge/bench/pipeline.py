"""``loongforge bench pipeline``: the pipeline bubble of plain and interleaved schedules, measured in real
training beside the bubble the plan predicts.

Each schedule is one ``loongforge train`` run of the same model on the same rows, two processes (PP 2)
on the CPU, one torch thread each: PP 2 (1F1B), PP 2 x VP 2 and PP 2 x VP 4 (megatron-core's
interleaved 1F1B), language layers split evenly. Each rank logs, per step, the wall and CPU seconds of
its pipeline schedule (``pipeline_s`` / ``pipeline_cpu_s``, ``train.step.StepResult``): with one thread
per process on cores of its own, CPU seconds are the rank's work and the rest of the wall time is the
time it waited for the other stage, the bubble. The measured bubble is the waiting time's share of the
schedule's wall time, averaged over the ranks and the steps after the warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Callable, Optional, Sequence

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.train import launch
from loongforge.train.metrics import METRICS_FILE, read_metrics
from loongforge.config.pipeline_layout import stage_plan
from loongforge.config.schema import RunConfig
from loongforge.train.pipeline_plan import predicted_timing, row_work

PRESET = "llm-tiny-small-vocab"
PIPELINE = 2
# Schedule name -> virtual stages per rank.
SCHEDULES = {"pp2": 1, "pp2-vp2": 2, "pp2-vp4": 4}
# 16 layers of width 256 (two per stage at VP 4) over 1024-token rows: the layers' work, not Python
# or messages, fills a stage; every stage the same but the first (embedding) and last (head, loss).
MODEL = ("model.language.num_layers=16", "model.language.hidden_size=256", "model.language.ffn_hidden_size=1024",
         "model.language.num_attention_heads=4", "model.language.num_query_groups=2",
         "model.language.tie_word_embeddings=false")


@dataclass(frozen=True)
class PipelineSettings:
    micro_batches: int = 4  # per step (one replica)
    seq_len: int = 1024
    steps: int = 6
    warmup_steps: int = 2


@dataclass
class ScheduleMeasure:
    schedule: str
    virtual: int
    micro_batches: int
    steps: int
    step_s: float  # rank 0's step, wall
    pipeline_s: list[float]  # per rank, the schedule's wall seconds per step
    idle_s: list[float]  # per rank, wall - CPU seconds of the schedule per step
    predicted_bubble: float

    @property
    def measured_bubble(self) -> float:
        """The ranks' waiting share of their schedule's wall time."""
        return mean(idle / wall for idle, wall in zip(self.idle_s, self.pipeline_s))


def run_overrides(virtual: int, out_dir: Path, settings: PipelineSettings) -> list[str]:
    return [*MODEL, f"parallel.world_size={PIPELINE}", f"parallel.pipeline_model_parallel_size={PIPELINE}",
            *([f"parallel.virtual_pipeline_model_parallel_size={virtual}"] if virtual > 1 else []),
            "data.source=synthetic", f"data.seq_len={settings.seq_len}",
            f"training.global_batch_size={settings.micro_batches}", f"training.train_steps={settings.steps}",
            f"logging.output_dir={out_dir}", f"logging.log_interval={settings.steps}", "logging.progress_bar=false",
            "logging.tensorboard=false", "checkpoint.save_at_end=false", "checkpoint.save_interval=0"]


def schedule_config(virtual: int, out_dir: Path, settings: PipelineSettings) -> RunConfig:
    return load_run_config(PRESET, world_size=PIPELINE, overrides=run_overrides(virtual, out_dir, settings))


def dry_run_bubble(cfg: RunConfig) -> float:
    """The bubble ``--dry-run`` predicts for ``cfg`` (``train.pipeline_plan``: its stages' FLOPs)."""
    stages = stage_plan(cfg.model.language.num_layers, cfg.parallel)
    return predicted_timing(row_work(cfg).chunks(stages), cfg.training.global_batch_size).bubble


def measure_schedule(schedule: str, records: list[dict], settings: PipelineSettings,
                     predicted_bubble: float) -> ScheduleMeasure:
    measured = [record for record in records if record["step"] > settings.warmup_steps]
    if not measured:
        raise ValueError(f"{schedule}: no step after the {settings.warmup_steps} warm-up steps; raise --steps")
    walls = list(zip(*(record["pipeline_s_by_rank"] for record in measured)))  # [rank][step]
    cpus = list(zip(*(record["pipeline_cpu_s_by_rank"] for record in measured)))
    virtual = SCHEDULES[schedule]
    return ScheduleMeasure(
        schedule=schedule, virtual=virtual, micro_batches=settings.micro_batches, steps=len(measured),
        step_s=mean(record["step_s"] for record in measured),
        pipeline_s=[mean(wall) for wall in walls],
        idle_s=[mean(w - c for w, c in zip(wall, cpu)) for wall, cpu in zip(walls, cpus)],
        predicted_bubble=predicted_bubble)


def run_pipeline_bench(out: Path, *, schedules: Sequence[str] = tuple(SCHEDULES),
                       settings: PipelineSettings = PipelineSettings(), report_only: bool = False,
                       command_line: Sequence[str] = (),
                       progress: Optional[Callable[[str], None]] = None) -> list[ScheduleMeasure]:
    """Train (or, with ``report_only``, reread) every schedule under ``out``; its measures."""
    unknown = [name for name in schedules if name not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule {unknown[0]!r}; choose from {', '.join(SCHEDULES)}")
    measures = []
    for name in schedules:
        run_dir = out / name
        cfg = schedule_config(SCHEDULES[name], run_dir, settings)
        if not report_only:
            if progress:
                progress(f"training {settings.steps} steps: {name}")
            launch.launch_local_workers(cfg, nproc_per_node=PIPELINE, resume=False, command_line=list(command_line))
        path = run_dir / METRICS_FILE
        if not path.is_file():
            raise InputError(f"no {path}: run the bench without --report-only first")
        measures.append(measure_schedule(name, read_metrics(path), settings, dry_run_bubble(cfg)))
    return measures


def format_table(measures: Sequence[ScheduleMeasure]) -> str:
    rows = ["| schedule | step s | schedule s per rank | waiting s per rank | bubble measured | bubble predicted "
            "| difference |", "|---|---:|---|---|---:|---:|---:|"]
    for m in measures:
        rows.append(f"| {m.schedule} | {m.step_s:.2f} | {' / '.join(f'{v:.2f}' for v in m.pipeline_s)} | "
                    f"{' / '.join(f'{v:.2f}' for v in m.idle_s)} | {100 * m.measured_bubble:.1f}% | "
                    f"{100 * m.predicted_bubble:.1f}% | {100 * (m.measured_bubble - m.predicted_bubble):+.1f} points |")
    return "\n".join(rows)


def format_doc(measures: Sequence[ScheduleMeasure], settings: PipelineSettings, command_line: str) -> str:
    baseline = measures[0]
    speed = [f"- {m.schedule}: step time {m.step_s / baseline.step_s:.2f} of {baseline.schedule}'s, bubble "
             f"{100 * m.measured_bubble:.1f}% measured against {100 * m.predicted_bubble:.1f}% predicted."
             for m in measures]
    return "\n".join([
        "# Pipeline schedules: the bubble measured beside the bubble predicted", "",
        f"Generated by\n```\n{command_line}\n```", "",
        f"- Model: `{PRESET}` with {', '.join(f'`{o}`' for o in MODEL)}; fp32 on CPU.",
        f"- PP {PIPELINE} (two processes, one torch thread each, gloo), DP 1; {settings.micro_batches} micro-batches "
        f"of one {settings.seq_len}-token synthetic row per step; {settings.steps} steps, the first "
        f"{settings.warmup_steps} left out. Language layers split evenly over the PP x VP stages.",
        "- Measured: each rank's pipeline schedule per step (forward and backward of every micro-batch, the "
        "gradient finalize), wall seconds and the process's CPU seconds; waiting = wall - CPU. With one "
        "thread per process on a core of its own, that is the time a rank had no work: the bubble (and "
        "the gradient finalize's waits, nothing at DP 1 with untied embeddings).",
        "- Predicted: the bubble `loongforge train --dry-run` prints for the same config (`train.pipeline_plan`: "
        "each stage's training FLOPs per micro-batch, the embedding's and LM head's stages included; for "
        "equal stages (PP - 1) / (VP x M + PP - 1)).", "",
        format_table(measures), "", *speed, "",
        "What the prediction leaves out: the messages between stages (a copy through gloo, counted as CPU "
        "work, VP times as many when interleaved), the time a rank spends outside the layers' FLOPs (Python "
        "per micro-batch and chunk, the loss), which makes a stage's work less even than its FLOPs, and "
        "the gradient finalize at the end of the schedule.",
    ]) + "\n"
