"""``loongforge train`` refuses, in one line with exit 2 and before any training code runs: a used
run folder (unless --resume or --overwrite), unreadable data, a folder that is a file, a device
the machine lacks, a config file that is not UTF-8 or has a wrongly typed key (with file:line)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from loongforge.cli.app import app
from tests.cli.test_train import assert_usage_error

runner = CliRunner()


@pytest.fixture
def trained(monkeypatch):
    """Records the configs the CLI would train with, instead of training."""
    calls = []
    monkeypatch.setattr("loongforge.train.launch.run_training_worker",
                        lambda cfg, resume, command_line: calls.append(cfg))
    return calls


def invoke(out_dir: Path, *args: str):
    return runner.invoke(app, ["train", "--output-dir", str(out_dir), *args])


def fake_run(out_dir: Path) -> dict[Path, bytes]:
    """A folder an earlier run left: two checkpoints and metrics; returns every file's bytes."""
    for step in (2, 4):
        step_dir = out_dir / "checkpoints" / f"step_{step:08d}"
        step_dir.mkdir(parents=True)
        (step_dir / "meta.json").write_text(f'{{"step": {step}}}')
        (step_dir / "weights.bin").write_bytes(bytes(range(256)) * step)
    (out_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (out_dir / "config.yaml").write_text("old: config\n")
    return snapshot(out_dir)


def snapshot(folder: Path) -> dict[Path, bytes]:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_fresh_train_into_a_used_folder_is_refused_and_changes_nothing(tmp_path, trained):
    before = fake_run(tmp_path / "run")
    lines = assert_usage_error(invoke(tmp_path / "run"), "already holds a run", "--resume",
                               "--overwrite", "logging.output_dir")
    assert len(lines) == 1 and not trained
    assert snapshot(tmp_path / "run") == before


def test_metrics_alone_mark_a_used_folder(tmp_path, trained):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert_usage_error(invoke(tmp_path / "run"), "already holds a run")
    assert not trained


def test_a_folder_without_a_run_is_fine(tmp_path, trained):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert invoke(tmp_path / "run").exit_code == 0 and len(trained) == 1


def test_overwrite_moves_the_earlier_run_aside_byte_identical(tmp_path, trained):
    before = fake_run(tmp_path / "run")
    result = invoke(tmp_path / "run", "--overwrite")
    assert result.exit_code == 0, result.output
    (moved,) = tmp_path.glob("run.old-*")
    assert snapshot(moved) == before and not (tmp_path / "run").exists()
    assert f"moved the earlier run {tmp_path / 'run'} to {moved}" in result.stderr
    assert len(trained) == 1


def test_overwrite_also_moves_a_separate_checkpoint_dir(tmp_path, trained):
    fake_run(tmp_path / "ckpt_parent")
    ckpt = tmp_path / "ckpt_parent" / "checkpoints"
    before = snapshot(ckpt)
    result = invoke(tmp_path / "run", f"checkpoint.dir={ckpt}", "--overwrite")
    assert result.exit_code == 0, result.output
    (moved,) = (tmp_path / "ckpt_parent").glob("checkpoints.old-*")
    assert snapshot(moved) == before


def test_resume_and_overwrite_together_is_a_usage_error(tmp_path, trained):
    fake_run(tmp_path / "run")
    assert_usage_error(invoke(tmp_path / "run", "--resume", "--overwrite"), "pass one of them")
    assert not trained


def test_resume_into_a_used_folder_is_allowed(tmp_path, trained):
    fake_run(tmp_path / "run")
    assert invoke(tmp_path / "run", "--resume").exit_code == 0 and len(trained) == 1


def test_output_dir_that_is_a_file_is_a_usage_error(tmp_path, trained):
    (tmp_path / "taken").write_text("a file")
    assert_usage_error(invoke(tmp_path / "taken"), "logging.output_dir=", "is a file, not a folder")
    assert not trained


@pytest.mark.parametrize("make, fragment", [
    (lambda d: d / "missing.jsonl", "does not exist"),
    (lambda d: (d / "nothing").mkdir() or d / "nothing", "holds no .json/.jsonl/.parquet files"),
    (lambda d: (d / "empty.jsonl").write_text("") and None or d / "empty.jsonl", "is empty"),
])
def test_unreadable_data_paths_are_one_line_before_the_model(tmp_path, trained, make, fragment):
    path = make(tmp_path)
    lines = assert_usage_error(invoke(tmp_path / "run", "data.source=files", f"data.paths=[{path}]"),
                               fragment)
    assert len(lines) == 1 and not trained


def test_cuda_without_cuda_is_a_usage_error(tmp_path, trained, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert_usage_error(invoke(tmp_path / "run", "training.device=cuda"), "training.device=cuda")
    assert not trained


def test_non_utf8_config_file_is_a_usage_error(tmp_path, trained):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("training:\n  train_steps: 3  # \xe9t\xe9\n".encode("latin-1"))
    assert_usage_error(invoke(tmp_path / "run", "--config", str(path)),
                       f"{path}: not UTF-8 text (byte 0xe9")


def test_yaml_type_errors_name_file_and_line(tmp_path, trained):
    path = tmp_path / "my.yaml"
    path.write_text("training:\n  train_steps: abc\noptimizer:\n  lr: 1e-4\n  lrr: 2\n")
    lines = assert_usage_error(invoke(tmp_path / "run", "--config", str(path)),
                               f"{path}:2: training.train_steps: expected an integer",
                               f"{path}:5: unknown key 'optimizer.lrr'")
    assert len(lines) == 2
    # The command line wins over the file, so a bad override is not blamed on the file.
    path.write_text("training:\n  train_steps: 5\n")
    lines = assert_usage_error(invoke(tmp_path / "run", "--config", str(path), "training.train_steps=x"))
    assert lines == ["error: training.train_steps: expected an integer, got 'x' (a string); "
                     "the default is 1000."]
