"""``loongforge bench encode``: what encoding offline costs, and what it saves in training.

All on one set of samples, COCO val2017 photos in caption chats (``bench.train_grid.coco_chats``),
with the encoder-heavy ``qwen2.5vl-tiny-vit`` preset, in one run:

1. ``loongforge encode`` at 1 and at 2 processes (fp32), and at 1 process in bf16: media per second
   (the encode call's own timing, ``runs.jsonl``: planning, model build and writing included);
2. bytes on disk per stored image token, bf16 and fp32 (shards and their headers);
3. training at TP 2 (2 processes, ``parallel.encoder_dp=none``) from the stored fp32 embeddings
   against the same training with the encoder online and frozen (tower and merger): wall step time
   (rank 0), the slowest rank's step CPU time, the slowest encoder rank's CPU time, peak memory per
   rank; and the online frozen run at ``encoder_dp=tp``, the best the encoder can do online here.
   Means over the steps after the warm-up; both sides train the same rows (losses are compared).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean
from typing import Optional

from tqdm import tqdm

from loongforge.bench.datasets import resolve_data_root
from loongforge.bench.train_grid import REQUIRED, BenchSettings, coco_chats, run_metrics
from loongforge.data.embedding_store import ENCODER_FILE, RUNS_FILE

PRESET = "qwen2.5vl-tiny-vit"
DATA_FILE = "coco_chats.json"
FROZEN = ("training.freeze_vision=true", "training.freeze_projector=true")
# (name, nproc, dtype) of each encode run; the first is what training reads.
ENCODES = (("fp32, 1 process", 1, "fp32"), ("fp32, 2 processes", 2, "fp32"), ("bf16, 1 process", 1, "bf16"))


@dataclass(frozen=True)
class EncodeBenchSettings(BenchSettings):
    """The training grid's row settings, and how many chats to encode and train on."""

    samples: int = 32


@dataclass
class EncodeMeasure:
    name: str
    processes: int
    dtype: str
    media: int
    tokens: int
    bytes: int
    seconds: float

    @property
    def media_per_s(self) -> float:
        return self.media / self.seconds

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens


@dataclass
class TrainMeasure:
    name: str
    steps: int
    losses: list
    step_s: float  # rank 0 wall, mean
    step_cpu_s: float  # slowest rank, mean
    encoder_cpu_s: Optional[float]  # slowest encoder rank, mean; None without an encoder
    peak_memory_mib: float  # largest rank


@dataclass
class EncodeBenchResult:
    settings: EncodeBenchSettings
    encodes: list
    trains: list

    def to_dict(self) -> dict:
        return {"settings": asdict(self.settings), "encodes": [asdict(e) for e in self.encodes],
                "trains": [asdict(t) for t in self.trains]}


def run_encode_bench(out: Path, data_root: Optional[Path], settings: EncodeBenchSettings = EncodeBenchSettings(),
                     progress: bool = True) -> EncodeBenchResult:
    data_root = resolve_data_root(data_root, REQUIRED)
    out.mkdir(parents=True, exist_ok=True)
    data_file = out / DATA_FILE
    data_file.write_text(json.dumps(coco_chats(data_root, settings.images_per_sample, settings.samples)))
    steps = [("encode", *spec) for spec in ENCODES] + [("train", name) for name in _train_runs(out)]
    encodes, trains = [], []
    for step in tqdm(steps, desc="bench encode", unit="run", disable=not progress):
        if step[0] == "encode":
            encodes.append(_encode(out, data_file, settings, *step[1:]))
        else:
            trains.append(_train(out, data_file, settings, step[1], _train_runs(out)[step[1]]))
    return EncodeBenchResult(settings=settings, encodes=encodes, trains=trains)


def _encode_dir(out: Path, name: str) -> Path:
    return out / ("encode-" + name.replace(", ", "-").replace(" ", "_"))


def _train_runs(out: Path) -> dict[str, tuple]:
    stored = _encode_dir(out, ENCODES[0][0])
    return {"online, frozen, encoder_dp=none": (*FROZEN, "parallel.encoder_dp=none"),
            "online, frozen, encoder_dp=tp": (*FROZEN, "parallel.encoder_dp=tp"),
            "stored embeddings (fp32)": ("parallel.encoder_dp=none", f"data.vision_embeddings={stored}")}


def _cli(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "loongforge.cli.app", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`loongforge {' '.join(args[:2])} ...` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def _encode(out: Path, data_file: Path, settings: EncodeBenchSettings, name: str, nproc: int,
            dtype: str) -> EncodeMeasure:
    folder = _encode_dir(out, name)
    again = ("--overwrite",) if folder.exists() else ()
    _cli("encode", str(data_file), "--output", str(folder), "--preset", PRESET, "--dtype", dtype,
         "--nproc-per-node", str(nproc), "--no-progress", "--set", f"data.seq_len={settings.seq_len}", *again)
    counts = json.loads((folder / ENCODER_FILE).read_text())["counts"]
    run = json.loads((folder / RUNS_FILE).read_text().splitlines()[-1])
    return EncodeMeasure(name=name, processes=nproc, dtype=dtype, media=counts["media"], tokens=counts["tokens"],
                         bytes=counts["bytes"], seconds=run["seconds"])


def _train(out: Path, data_file: Path, settings: EncodeBenchSettings, name: str, extra: tuple) -> TrainMeasure:
    run_dir = out / ("train-" + name.replace(", ", "-").replace(" ", "_").replace("(", "").replace(")", ""))
    _cli("train", "--preset", PRESET, "--nproc-per-node", "2", "--overwrite", "data.source=files",
         f"data.paths=[{data_file}]", f"data.seq_len={settings.seq_len}",
         f"training.global_batch_size={settings.micro_batches}", f"training.train_steps={settings.steps}",
         "parallel.tensor_model_parallel_size=2", "parallel.vision_tensor_model_parallel_size=1",
         f"logging.output_dir={run_dir}", "logging.progress_bar=false", "logging.tensorboard=false",
         "checkpoint.save_at_end=false", *extra)
    return measure_train(name, run_metrics(run_dir), settings.warmup_steps)


def measure_train(name: str, records: list[dict], warmup_steps: int) -> TrainMeasure:
    measured = [r for r in records if r["step"] > warmup_steps]
    if not measured:
        raise ValueError(f"{name}: no step after the {warmup_steps} warm-up steps; raise --steps")
    encoder = [max((v for v in r["encoder_cpu_s_by_rank"] if v is not None), default=None) for r in measured]
    return TrainMeasure(
        name=name, steps=len(measured), losses=[r["loss"] for r in records],
        step_s=mean(r["step_s"] for r in measured),
        step_cpu_s=mean(max(r["step_cpu_s_by_rank"]) for r in measured),
        encoder_cpu_s=None if encoder[0] is None else mean(encoder),
        peak_memory_mib=max(max(r["peak_memory_mib_by_rank"]) for r in measured))


def format_report(result: EncodeBenchResult) -> str:
    base = result.encodes[0]
    lines = ["| encode | media | media/s | vs fp32, 1 process | bytes per image token |",
             "|---|---:|---:|---:|---:|"]
    for e in result.encodes:
        lines.append(f"| {e.name} | {e.media} | {e.media_per_s:.2f} | {e.media_per_s / base.media_per_s:.2f}x | "
                     f"{e.bytes_per_token:.0f} |")
    online = result.trains[0]
    lines += ["", "| training (TP 2, 2 processes) | step wall s | step CPU s (slowest rank) | vs online none | "
              "encoder CPU s (slowest rank) | peak memory MiB (largest rank) | vs online none |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for t in result.trains:
        encoder = "-" if t.encoder_cpu_s is None else f"{t.encoder_cpu_s:.2f}"
        lines.append(f"| {t.name} | {t.step_s:.2f} | {t.step_cpu_s:.2f} | {t.step_cpu_s / online.step_cpu_s:.2f}x | "
                     f"{encoder} | {t.peak_memory_mib:.0f} | {t.peak_memory_mib / online.peak_memory_mib:.2f}x |")
    return "\n".join(lines)


def summary_lines(result: EncodeBenchResult) -> list[str]:
    online, stored = result.trains[0], result.trains[-1]
    same = max(abs(a - b) / abs(b) for a, b in zip(stored.losses, online.losses))
    two = next(e for e in result.encodes if e.processes == 2)
    return [f"encode: {result.encodes[0].media_per_s:.2f} media/s at 1 process, {two.media_per_s:.2f} at 2",
            f"training from stored embeddings: step CPU {stored.step_cpu_s / online.step_cpu_s:.2f}x, "
            f"peak memory {stored.peak_memory_mib / online.peak_memory_mib:.2f}x of the frozen online encoder; "
            f"losses equal to {same:.1e} (relative)"]


def write_doc(result: EncodeBenchResult, path: Path, command: str) -> None:
    """The benchmark document: how it was made, the tables, the summary."""
    s = result.settings
    text = "\n".join([
        "# `loongforge encode`: cost of encoding offline, and training without the encoder",
        "",
        f"Generated by `{command}` (`loongforge/bench/encode.py`). CPU, 2 cores shared with other "
        "work: CPU-second columns count a process's own work and are the comparable ones; wall "
        "seconds include waiting for the cores.",
        "",
        f"Data: {s.samples} caption chats of {s.images_per_sample} COCO val2017 photos each (the real "
        f"files, at the `{PRESET}` preset's 448 x 448 pixel limit). Training: `{PRESET}` at TP 2 "
        f"(2 processes, vision TP 1), {s.micro_batches} micro-batches of {s.seq_len} tokens per step, "
        f"{s.steps} steps, the first {s.warmup_steps} left out of the means.",
        "",
        format_report(result),
        "",
        *[f"- {line}" for line in summary_lines(result)],
        "",
        "Encode media/s is the whole call (planning, building the encoder, decoding, encoding, writing): "
        "on a few dozen images the fixed start-up weighs; bytes per token are the stored width times "
        "the dtype's size plus the shard headers.",
        "",
    ])
    path.write_text(text)
