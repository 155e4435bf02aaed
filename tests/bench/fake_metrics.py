"""Fake ``metrics.jsonl`` step records for the benches that read a grid of training runs
(``bench.train_grid``): the figures they report, with no training."""

from __future__ import annotations

import json
from pathlib import Path

from loongforge.train.metrics import METRICS_FILE


def step_records(encoder_cpu: list, step_s: float, memory: list, steps: int = 3) -> list[dict]:
    """Per-step records; step 1 (the warm-up) is 10x slower so that counting it shows. Encoder wall
    time is twice the CPU time, step CPU time the step's wall time, peak memory grows 1 MiB a step."""
    return [{"step": step, "step_s": step_s * (10 if step == 1 else 1),
             "encoder_cpu_s_by_rank": [None if v is None else v * (10 if step == 1 else 1) for v in encoder_cpu],
             "encoder_s_by_rank": [None if v is None else 2 * v for v in encoder_cpu],
             "step_cpu_s_by_rank": [step_s] * len(encoder_cpu),
             "peak_memory_mib_by_rank": [m + step for m in memory]} for step in range(1, steps + 1)]


def write_run(run_dir: Path, records: list[dict]) -> None:
    """A run folder as ``loongforge train`` leaves it, as far as the benches read it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(record) + "\n" for record in records))
