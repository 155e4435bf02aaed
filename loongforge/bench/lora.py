"""``loongforge bench lora``: full fine-tuning against LoRA on the same model, data and steps, in one run.

Each variant trains in a fresh ``loongforge train`` process (so its peak memory is its own) on the
same samples: full fine-tuning first, from the run's initial weights (or the ``checkpoint.load_hf``
given), writing its result as an HF folder (``checkpoint.save_hf``), then LoRA (``lora.rank`` and the
other ``lora.*`` settings given) on that folder as its frozen base (``checkpoint.load_hf``), as LoRA
is run on a published model. Measured per variant:
- trainable parameters (the plan's arithmetic: ``models.layers.lora_params`` for the adapters);
- the final checkpoint's bytes on disk (a LoRA checkpoint holds what trains: the adapters and their
  optimizer state, and names the base it applies to);
- peak memory per rank (``peak_memory_mib_by_rank``: resident set on CPU, which includes the
  runtime both variants share; the allocator's peak on CUDA);
- step time: the mean ``step_s`` of the steps after ``warmup_steps``.
The report gives LoRA's figures as ratios of full fine-tuning's, measured in the same invocation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean
from typing import Callable, Sequence

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.models.layers.lora_params import adapter_parameters
from loongforge.models.registry import get_family
from loongforge.train.metrics import METRICS_FILE, read_metrics

VARIANTS = ("full", "lora")


@dataclass(frozen=True)
class VariantMeasure:
    variant: str
    trainable_parameters: int
    checkpoint_bytes: int
    peak_memory_mib: float  # the largest rank's
    step_s: float  # mean over the measured steps
    losses: list
    checkpoint: str  # the final checkpoint's folder


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def trainable_parameters(preset: str, overrides: Sequence[str]) -> int:
    cfg = load_run_config(preset, overrides=list(overrides))
    if cfg.lora.rank:
        return adapter_parameters(cfg.model, cfg.lora, tensor_parallel=1, vision_tensor_parallel=1,
                                  expert_parallel=1).total
    return int(get_family(cfg.model.family).count_parameters(cfg.model)["total"])


def variant_overrides(variant: str, common: Sequence[str], lora: Sequence[str], out: Path) -> list[str]:
    return [*common, *(lora if variant == "lora" else ()), f"logging.output_dir={out / variant}",
            "checkpoint.save_at_end=true", "checkpoint.save_interval=0", "logging.log_interval=1",
            "logging.progress_bar=false", "logging.tensorboard=false"]


def train_variant(preset: str, overrides: Sequence[str]) -> None:
    """One ``loongforge train`` in a fresh process; its error output is the InputError on failure."""
    command = [sys.executable, "-m", "loongforge.cli.app", "train", "--preset", preset, "--overwrite", *overrides]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise InputError(f"bench lora: `loongforge train --preset {preset} ...` failed ({proc.returncode}): "
                         f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.stdout[-500:]}")


def measure_variant(variant: str, run: Path, warmup_steps: int, trainable: int) -> VariantMeasure:
    records = read_metrics(run / METRICS_FILE)
    summary = json.loads((run / "summary.json").read_text())
    measured = records[warmup_steps:]
    return VariantMeasure(
        variant=variant, trainable_parameters=trainable,
        checkpoint_bytes=folder_bytes(Path(summary["checkpoint"])), checkpoint=summary["checkpoint"],
        peak_memory_mib=max(max(r["peak_memory_mib_by_rank"]) for r in measured),
        step_s=mean(r["step_s"] for r in measured), losses=[r["loss"] for r in records])


def run_lora_bench(out: Path, *, preset: str, common: Sequence[str], lora: Sequence[str], warmup_steps: int,
                   progress: Callable[[str], None] = lambda message: None) -> dict[str, VariantMeasure]:
    measures = {}
    for variant in VARIANTS:
        overrides = variant_overrides(variant, common, lora, out)
        if variant == "full":
            overrides.append("checkpoint.save_hf=true")
        else:
            overrides.append(f"checkpoint.load_hf={out / 'full' / 'hf'}")
        progress(f"training {variant} ({preset})")
        train_variant(preset, overrides)
        measures[variant] = measure_variant(variant, out / variant, warmup_steps,
                                            trainable_parameters(preset, [*common, *(lora if variant == "lora" else ())]))
    (out / "lora.json").write_text(json.dumps({v: asdict(m) for v, m in measures.items()}, indent=2) + "\n")
    return measures


def format_report(measures: dict[str, VariantMeasure], device: str) -> str:
    full, lora = measures["full"], measures["lora"]
    rows = [("trainable parameters", f"{full.trainable_parameters:,}", f"{lora.trainable_parameters:,}",
             f"{full.trainable_parameters / lora.trainable_parameters:.0f}x fewer"),
            ("checkpoint on disk", f"{full.checkpoint_bytes / 2**20:.1f} MiB", f"{lora.checkpoint_bytes / 2**20:.1f} MiB",
             f"{full.checkpoint_bytes / lora.checkpoint_bytes:.1f}x smaller"),
            ("peak memory per rank", f"{full.peak_memory_mib:.0f} MiB", f"{lora.peak_memory_mib:.0f} MiB",
             f"{lora.peak_memory_mib / full.peak_memory_mib:.2f}x"),
            ("step time", f"{full.step_s:.2f} s", f"{lora.step_s:.2f} s", f"{lora.step_s / full.step_s:.2f}x")]
    memory = "resident set, runtime included" if device == "cpu" else "allocator peak"
    lines = [f"| {device} | full fine-tuning | LoRA | LoRA vs full |", "|---|---|---|---|"]
    lines += [f"| {name} | {a} | {b} | {ratio} |" for name, a, b, ratio in rows]
    return "\n".join(lines) + f"\n\n(peak memory: {memory}; step time: mean after the warm-up steps)"
