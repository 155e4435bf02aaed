"""Launch detection, and the elastic launcher spawning real workers (entrypoint writes a file)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from loongforge.config.loader import load_run_config
from loongforge.parallel import fork_server, launch_env
from loongforge.train import launch as launcher

# Which process imported this module: in a worker, the fork server (its parent) when the server's
# preload (the entrypoint's module) took effect; the worker itself had it not.
IMPORTED_BY_PID = os.getpid()


def record_rank(cfg, resume, command_line):
    """Worker entrypoint: proves each worker got the config and launch variables, and was forked
    with its module imported already."""
    out = Path(cfg.logging.output_dir)
    preloaded = "preloaded" if IMPORTED_BY_PID == os.getppid() != os.getpid() else f"imported by {IMPORTED_BY_PID}"
    text = f"{os.environ['WORLD_SIZE']} {resume} {command_line[0]} {preloaded}"
    (out / f"rank{os.environ['RANK']}").write_text(text)


def reject_on_rank_1(cfg, resume, command_line):
    """Worker entrypoint: rank 1 meets a usage problem after start-up (e.g. its shard all rejected)."""
    from loongforge.config.errors import InputError

    if os.environ["RANK"] == "1":
        raise InputError("data.paths: all 6 samples of this rank's share were rejected (too_long: 6)")


def test_external_launch_detection():
    assert launch_env.external_launch_world_size({}) is None
    assert launch_env.external_launch_world_size({"RANK": "0", "WORLD_SIZE": "4"}) == 4
    assert launch_env.external_launch_world_size({"SLURM_PROCID": "0", "SLURM_NTASKS": "16"}) == 16
    assert launch_env.resolve_world_size(2, {}) == 2
    assert launch_env.resolve_world_size(2, {"RANK": "0", "WORLD_SIZE": "4"}) == 4
    assert launch_env.resolve_world_size(None, {}) is None
    assert launch_env.needs_local_workers(2, {}) is True
    assert launch_env.needs_local_workers(1, {}) is False
    assert launch_env.needs_local_workers(2, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}) is False


@pytest.mark.timeout(120)
def test_free_ports_lie_below_the_kernels_ephemeral_range():
    """A port from bind(0) can be taken by any outgoing connection before the store binds it (CI
    lost a run to EADDRINUSE that way); one below the range cannot."""
    low, _ = launch_env._ephemeral_port_range()
    ports = {launch_env.free_port() for _ in range(20)}
    print(f"ephemeral range starts at {low}; ports {sorted(ports)[:5]}...")
    assert all(10000 <= port < low for port in ports)
    assert len(ports) > 10  # drawn at random: concurrent runs do not agree on one


def test_a_free_port_skips_one_that_is_taken(monkeypatch):
    held_port = launch_env.free_port()
    spare = next(port for port in iter(launch_env.free_port, None) if port != held_port)
    monkeypatch.setattr(launch_env.random.SystemRandom, "sample", lambda self, population, k: [held_port, spare])
    with socket.socket() as held:
        held.bind(("127.0.0.1", held_port))
        held.listen()
        assert launch_env.free_port() == spare


def test_tensor_parallel_runs_order_their_kernels_on_one_cuda_queue():
    """megatron's TP linears overlap a collective with the next GEMM only when CUDA starts them in
    order (one queue); a launch's own choice is kept."""
    env: dict[str, str] = {}
    assert launch_env.order_tensor_parallel_kernels(False, env) is False and env == {}
    assert launch_env.order_tensor_parallel_kernels(True, env) is True
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    chosen = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    assert launch_env.order_tensor_parallel_kernels(True, chosen) is False and chosen["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


def test_launch_local_workers_runs_entrypoint_on_every_rank(tmp_path):
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2,
                          overrides=[f"logging.output_dir={tmp_path}"])
    launcher.launch_local_workers(cfg, nproc_per_node=2, resume=True, command_line=["loongforge"],
                                  entrypoint=record_rank)
    assert (tmp_path / "rank0").read_text() == "2 True loongforge preloaded"
    assert (tmp_path / "rank1").read_text() == "2 True loongforge preloaded"


@pytest.mark.timeout(120)
def test_a_usage_problem_in_a_worker_is_one_input_error_not_tracebacks(tmp_path):
    """The worker's message reaches the launcher (and the CLI's one line, exit 2)."""
    from loongforge.config.errors import InputError

    cfg = load_run_config("qwen2.5vl-tiny", world_size=2, overrides=[f"logging.output_dir={tmp_path}"])
    with pytest.raises(InputError, match=r"^data.paths: all 6 samples of this rank's share were rejected"):
        launcher.launch_local_workers(cfg, nproc_per_node=2, resume=False, command_line=["x"],
                                      entrypoint=reject_on_rank_1)


def test_the_fork_server_preloads_what_the_workers_import():
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2)
    assert launcher._worker_preload(launcher.run_training_worker, cfg) == [
        "loongforge.parallel.quiet_known_warnings", "loongforge.train.launch", "loongforge.train.runner",
        "torch._dynamo", "transformers"]
    files = load_run_config("qwen2.5vl-tiny", world_size=2, overrides=["data.source=files", "data.paths=[x.jsonl]",
                                                                       "logging.verbose=true"])
    assert launcher._worker_preload(launcher.run_training_worker, files)[0] == "loongforge.train.launch"
    assert launcher._worker_preload(launcher.run_training_worker, files)[-1] == "datasets"
    assert launcher._worker_preload(record_rank, cfg)[1:] == ["loongforge.train.launch", __name__]


def test_the_fork_server_starts_before_the_checks_and_stops_when_they_refuse_the_run():
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2)
    with pytest.raises(RuntimeError, match="refused"):
        with launcher.worker_server_started(cfg, nproc_per_node=2, entrypoint=record_rank):
            assert fork_server.pid() is not None
            raise RuntimeError("refused")
    assert fork_server.pid() is None
    with launcher.worker_server_started(cfg, nproc_per_node=1, entrypoint=record_rank):
        assert fork_server.pid() is None  # one process: no workers to fork


def test_failed_worker_raises_launch_error_naming_the_rank(monkeypatch):
    # Spawning a failing worker costs as much as the test above; the mapping is what matters here.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failing_launch(config, entrypoint):
        assert (config.start_method, config.max_restarts, config.nproc_per_node) == ("forkserver", 0, 2)
        assert config.rdzv_endpoint.startswith("127.0.0.1:")
        failure = ProcessFailure(local_rank=1, pid=123, exitcode=3, error_file="/nonexistent")
        raise ChildFailedError("record_rank", {1: failure})

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch",
                        lambda config, entrypoint: lambda *args: failing_launch(config, entrypoint))
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2)
    with pytest.raises(launcher.LaunchError, match=r"rank 1 \(exit code 3\)"):
        launcher.launch_local_workers(cfg, nproc_per_node=2, resume=False, command_line=["x"],
                                      entrypoint=record_rank)


def _fake_launch(monkeypatch, error: Exception) -> None:
    def launch(config, entrypoint):
        assert config.shutdown_timeout == 600  # parallel.collective_timeout_s: time to save
        raise error

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch",
                        lambda config, entrypoint: lambda *args: launch(config, entrypoint))


@pytest.mark.parametrize("codes, expected", [((143, 143), 143), ((130, 143), 143), ((130,), 130),
                                             ((-15, 143), 143)])  # -15: signalled during start-up
def test_workers_stopped_by_a_signal_exit_with_their_code(monkeypatch, codes, expected):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                                     error_file="/nonexistent") for rank, code in enumerate(codes)}
    _fake_launch(monkeypatch, ChildFailedError("record_rank", failures))
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2)
    with pytest.raises(SystemExit) as stopped:
        launcher.launch_local_workers(cfg, nproc_per_node=2, resume=False, command_line=["x"],
                                      entrypoint=record_rank)
    assert stopped.value.code == expected


def test_a_signal_stop_mixed_with_a_crash_is_a_failure(monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {0: ProcessFailure(local_rank=0, pid=1, exitcode=143, error_file="/nonexistent"),
                1: ProcessFailure(local_rank=1, pid=2, exitcode=-9, error_file="/nonexistent")}
    _fake_launch(monkeypatch, ChildFailedError("record_rank", failures))
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2)
    with pytest.raises(launcher.LaunchError, match=r"rank 1 \(exit code -9\)"):
        launcher.launch_local_workers(cfg, nproc_per_node=2, resume=False, command_line=["x"],
                                      entrypoint=record_rank)


def test_a_signalled_launcher_exits_with_the_signal_code(monkeypatch):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    _fake_launch(monkeypatch, SignalException("got SIGINT", sigval=signal.SIGINT))
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2)
    with pytest.raises(SystemExit) as stopped:
        launcher.launch_local_workers(cfg, nproc_per_node=2, resume=False, command_line=["x"],
                                      entrypoint=record_rank)
    assert stopped.value.code == 130


# A parent that starts a child tied to it with die_with_parent, prints the child's pid and sleeps.
_PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import os, time; from loongforge.train.launch import die_with_parent; "
    f"assert die_with_parent({os.getpid()}); print('tied', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "tied"
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_worker_dies_with_a_killed_launcher():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    parent.kill()  # SIGKILL: the parent runs no clean-up of its own
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child_pid):
        time.sleep(0.05)
    assert not _alive(child_pid)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
def test_launching_leaves_this_process_signal_handlers_as_they_were(tmp_path):
    """torch's agent installs handlers for the launch; a later fork (a pack worker pool) must not
    inherit them."""
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    before = {sig: signal.getsignal(sig) for sig in stop_signals}
    cfg = load_run_config("qwen2.5vl-tiny", world_size=2, overrides=[f"logging.output_dir={tmp_path}"])
    launcher.launch_local_workers(cfg, nproc_per_node=2, resume=False, command_line=["x"],
                                  entrypoint=record_rank)
    assert {sig: signal.getsignal(sig) for sig in stop_signals} == before
