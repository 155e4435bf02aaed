"""``loongforge convert`` interrupted: SIGINT / SIGTERM clean up and exit 130 / 143 with one line;
staging folders of killed conversions (SIGKILL) are removed by the next one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.convert.helpers import invoke, save_hf_checkpoint
from tests.models.helpers import tiny_model_cfg

# Runs the real CLI in a fresh process that sends itself `signal` while the third HF tensor is read,
# that is inside the megatron writer with the staging folder half full: a deterministic Ctrl-C.
SIGNAL_MIDWAY = """
import os, signal, sys, time
from loongforge.convert.hf_io import HFCheckpoint
from loongforge.cli.app import app

real_load, calls = HFCheckpoint.load, []

def load_then_signal(self, key):
    calls.append(key)
    if len(calls) == 3:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        time.sleep(20)  # the handler raises in here; a missing handler would let the test time out
    return real_load(self, key)

HFCheckpoint.load = load_then_signal
app(["convert", sys.argv[2], sys.argv[3], "--to", "mcore", "--no-progress"])
"""


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    save_hf_checkpoint(folder, tiny_model_cfg(tie=False), style="hub")
    return folder


@pytest.mark.parametrize("name, exit_code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_midway_removes_the_staging_folder_and_exits_with_one_line(hf_tiny, tmp_path, name, exit_code):
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", SIGNAL_MIDWAY, name, str(hf_tiny), str(out / "mcore")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    # The one line and nothing else: no third-party warning either (issue 30, item 13).
    assert proc.stderr.strip().splitlines() == [
        f"error: convert interrupted by {name}; its partial output was removed"], proc.stderr[-3000:]
    assert list(out.iterdir()) == []  # neither DST nor .mcore.tmp-<pid>


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_next_run_removes_staging_folders_of_dead_processes_only(hf_tiny, tmp_path):
    dead = tmp_path / f".mcore.tmp-{_dead_pid()}"  # what SIGKILL leaves: no handler ran
    (dead / "model_optim").mkdir(parents=True)
    (dead / "model_optim" / "__0_0.distcp").write_bytes(bytes(1024))
    alive_process = subprocess.Popen(["sleep", "60"])
    try:
        alive = tmp_path / f".mcore.tmp-{alive_process.pid}"  # a conversion still running
        alive.mkdir()
        result = invoke(str(hf_tiny), str(tmp_path / "mcore"), "--to", "mcore")
        assert result.exit_code == 0, result.output
        assert f"removed {dead.name}, left by process {dead.name.rsplit('-', 1)[1]} which no longer runs" \
            in result.output
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, "mcore"])
    finally:
        alive_process.kill()
        alive_process.wait()
