"""A run folder belongs to one run: a failed --resume changes none of its files, and a resumed run
logs every step once in metrics.jsonl (real CLI runs on the small model, copies of the baseline)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from loongforge.train.metrics import drop_metrics_after
from tests.train.conftest import losses, run_train

RUN_FILES = ("config.yaml", "command.txt", "environment.json", "metrics.jsonl")


def metric_steps(out_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_drop_metrics_after_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2, 3, 4, 3)))
    drop_metrics_after(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    drop_metrics_after(tmp_path / "absent.jsonl", 2)  # a run that never logged: nothing to do
    assert not (tmp_path / "absent.jsonl").exists()


def test_failed_resume_leaves_the_run_files_unchanged(baseline_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(baseline_run, run)
    before = {name: (run / name).read_bytes() for name in RUN_FILES}
    # A changed model cannot load the run's checkpoint; config.yaml must still describe the run
    # that wrote it (convert reads it).
    proc = run_train(run, "model.language.num_layers=3", "training.train_steps=6", resume=True,
                     expect_ok=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert {name: (run / name).read_bytes() for name in RUN_FILES} == before


def test_resume_logs_every_step_once(baseline_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(baseline_run, run)
    # As if the run had logged steps 5 and 6 and died before their checkpoint (the latest is 4).
    with open(run / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps({"step": step, "loss": 99.0}) + "\n" for step in (5, 6))
    run_train(run, "training.train_steps=6", resume=True)
    assert metric_steps(run) == [1, 2, 3, 4, 5, 6]
    assert 99.0 not in losses(run) and losses(run)[:4] == losses(baseline_run)
