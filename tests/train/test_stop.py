"""A signalled 2-process run stops every rank at one step, saves, exits 143 and resumes exactly; no
process of a job outlives it, also when one rank is killed with SIGKILL in the middle of a save.

Each job runs in its own session (start_new_session), so "the job's processes" are those whose
session id is the launcher's pid, whoever their parent is after a death (orphans are reparented).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from loongforge.parallel.progress import RankProgress
from loongforge.train.runner import _named_timeout
from loongforge.train.stop import StopRequest, catch_stop_signals, exit_code
from tests.train.conftest import PRESET, losses, run_train, train_command, train_env

# The stop is asked for once 2 steps are logged and lands at step 3 or so: 8 steps leave it room.
TRAIN_STEPS = 8
STEPS = (f"training.train_steps={TRAIN_STEPS}",)


def start_job(out_dir: Path, *extra: str, preset: str = PRESET) -> tuple[subprocess.Popen, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir.parent / f"{out_dir.name}.log"
    with open(log, "w") as stream:
        proc = subprocess.Popen(train_command(out_dir, *extra, nproc=2, preset=preset), stdout=stream,
                                stderr=subprocess.STDOUT, env=train_env(2), start_new_session=True)
    return proc, log


def job_processes(session_id: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session_id and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def wait_until(condition, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    return condition()


def assert_no_job_process_left(proc: subprocess.Popen, within_s: float) -> None:
    try:
        wait_until(lambda: not job_processes(proc.pid), within_s)
        left = [(p.pid, " ".join(p.cmdline())[:120]) for p in job_processes(proc.pid)]
        assert not left, f"processes of the job still alive after {within_s} s: {left}"
    finally:
        for process in job_processes(proc.pid):  # never leave a test's processes behind
            process.kill()


def fork_servers(launcher_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(launcher_pid).children()
            if "multiprocessing.forkserver" in " ".join(p.cmdline())]


def worker_processes(launcher_pid: int) -> list[psutil.Process]:
    """The job's training workers, in the order they were forked: the children of the launcher's
    fork server."""
    return sorted((w for server in fork_servers(launcher_pid) for w in server.children()), key=lambda p: p.pid)


def logged_steps(out_dir: Path) -> int:
    metrics = out_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def test_a_signal_is_recorded_not_fatal_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with catch_stop_signals() as request:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # a later Ctrl-C must not cancel the stop-save
        assert wait_until(lambda: request.signum, 1.0) == signal.SIGTERM
        assert request.agree() == signal.SIGTERM  # no process group: this process decides alone
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert exit_code(signal.SIGTERM) == 143 and exit_code(signal.SIGINT) == 130


def test_nothing_recorded_means_keep_training():
    assert StopRequest().agree() == 0


def test_a_collective_timeout_names_the_rank_the_step_and_the_key():
    torch_error = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms "
                               "for recv operation to complete")
    progress = RankProgress(None, rank=1, world_size=1)
    progress.begin_step(7)
    named = _named_timeout(torch_error, 5, progress)
    assert str(named).startswith("rank 1, step 7: a collective waited more than "
                                 "parallel.collective_timeout_s=5 s (torch: [gloo")
    other = RuntimeError("shape mismatch")
    assert _named_timeout(other, 5, progress) is other


@pytest.mark.timeout(480)
def test_sigterm_stops_every_rank_saves_and_resumes_identically(tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    run_train(uninterrupted, *STEPS, nproc=2)

    out = tmp_path / "stopped"
    proc, log = start_job(out, *STEPS)
    try:
        assert wait_until(lambda: logged_steps(out) >= 2 or proc.poll() is not None, 300)
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)  # to the launcher only, as Kubernetes does
        signalled = time.monotonic()
        returncode = proc.wait(timeout=60)
        took_s = time.monotonic() - signalled
    finally:
        assert_no_job_process_left(proc, within_s=10)
    text = log.read_text()
    assert returncode == 143, text[-3000:]
    match = re.search(r"stopped at step (\d+); resume with --resume", text)
    assert match, text[-3000:]
    stop_step = int(match.group(1))
    assert 2 <= stop_step < TRAIN_STEPS and took_s < 60
    assert (out / "checkpoints" / f"step_{stop_step:08d}" / "meta.json").is_file()
    assert logged_steps(out) == stop_step  # both ranks stopped after the same step

    run_train(out, *STEPS, nproc=2, resume=True)
    assert losses(out) == losses(uninterrupted)


@pytest.mark.timeout(300)
def test_kill_9_of_the_writing_rank_during_a_save_leaves_no_process(tmp_path):
    out = tmp_path / "killed"
    # The full vocabulary: its 231 MB checkpoint takes long enough to write that the save is caught
    # in progress (the small vocabulary's 14 MB one is often done between two polls).
    proc, log = start_job(out, "training.train_steps=40", "checkpoint.save_interval=1", preset="qwen2.5vl-tiny")
    try:
        # Not the first save: megatron's helpers (if any) exist from the first save on.
        saving = wait_until(lambda: proc.poll() is not None or (
            (out / "checkpoints" / "step_00000002").is_dir()
            and any((out / "checkpoints").glob("step_*.tmp"))), 300, interval_s=0.005)
        assert saving and proc.poll() is None, "no save was caught in progress:\n" + log.read_text()[-3000:]
        workers = worker_processes(proc.pid)
        assert len(workers) == 2, workers
        # The first forked, rank 0: with DP replicas only it writes files (rank 1 has no writer).
        workers[0].kill()
        returncode = proc.wait(timeout=10)
    finally:
        assert_no_job_process_left(proc, within_s=10)
    assert returncode not in (0, 143), log.read_text()[-3000:]


@pytest.mark.timeout(300)
def test_kill_9_of_the_launcher_while_training_leaves_no_process(tmp_path):
    """The workers' parent is the fork server: it exits with the launcher, and they with it."""
    out = tmp_path / "launcher_killed"
    proc, log = start_job(out, "training.train_steps=40")
    try:
        assert wait_until(lambda: logged_steps(out) >= 1 or proc.poll() is not None, 300)
        assert proc.poll() is None, log.read_text()[-3000:]
        assert len(worker_processes(proc.pid)) == 2
        proc.kill()  # SIGKILL: the launcher runs no clean-up of its own
        proc.wait(timeout=10)
    finally:
        assert_no_job_process_left(proc, within_s=10)


@pytest.mark.timeout(120)
def test_kill_9_of_the_launcher_while_the_fork_server_imports_leaves_no_process(tmp_path):
    """Before it forks a worker the server imports the training code (seconds), deaf to its alive pipe."""
    proc, log = start_job(tmp_path / "launcher_killed_early", "training.train_steps=40")
    try:
        assert wait_until(lambda: proc.poll() is not None or fork_servers(proc.pid), 60, interval_s=0.01)
        assert proc.poll() is None and not worker_processes(proc.pid), log.read_text()[-3000:]
        proc.kill()
        proc.wait(timeout=10)
    finally:
        assert_no_job_process_left(proc, within_s=10)
