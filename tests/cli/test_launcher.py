"""Launch detection, and the elastic launcher spawning real workers (entrypoint writes a file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loongforge.config.loader import load_run_config
from loongforge.parallel import launcher


def record_rank(cfg, resume, command_line):
    """Worker entrypoint: proves each spawned process got the config and launch variables."""
    out = Path(cfg.logging.output_dir)
    text = f"{os.environ['WORLD_SIZE']} {resume} {command_line[0]}"
    (out / f"rank{os.environ['RANK']}").write_text(text)


def test_external_launch_detection():
    assert launcher.external_launch_world_size({}) is None
    assert launcher.external_launch_world_size({"RANK": "0", "WORLD_SIZE": "4"}) == 4
    assert launcher.external_launch_world_size({"SLURM_PROCID": "0", "SLURM_NTASKS": "16"}) == 16
    assert launcher.resolve_world_size(2, {}) == 2
    assert launcher.resolve_world_size(2, {"RANK": "0", "WORLD_SIZE": "4"}) == 4
    assert launcher.resolve_world_size(None, {}) is None
    assert launcher.needs_local_workers(2, {}) is True
    assert launcher.needs_local_workers(1, {}) is False
    assert launcher.needs_local_workers(2, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}) is False


@pytest.mark.timeout(120)
def test_launch_local_workers_runs_entrypoint_on_every_rank(tmp_path):
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2,
                          overrides=[f"logging.output_dir={tmp_path}"])
    launcher.launch_local_workers(cfg, nproc_per_node=2, resume=True, command_line=["loongforge"],
                                  entrypoint=record_rank)
    assert (tmp_path / "rank0").read_text() == "2 True loongforge"
    assert (tmp_path / "rank1").read_text() == "2 True loongforge"


def test_failed_worker_raises_launch_error_naming_the_rank(monkeypatch):
    # Spawning a failing worker costs as much as the test above; the mapping is what matters here.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failing_launch(config, entrypoint):
        assert (config.start_method, config.max_restarts, config.nproc_per_node) == ("spawn", 0, 2)
        assert config.rdzv_endpoint.startswith("127.0.0.1:")
        failure = ProcessFailure(local_rank=1, pid=123, exitcode=3, error_file="/nonexistent")
        raise ChildFailedError("record_rank", {1: failure})

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch",
                        lambda config, entrypoint: lambda *args: failing_launch(config, entrypoint))
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2)
    with pytest.raises(launcher.LaunchError, match=r"rank 1 \(exit code 3\)"):
        launcher.launch_local_workers(cfg, nproc_per_node=2, resume=False, command_line=["x"],
                                      entrypoint=record_rank)
