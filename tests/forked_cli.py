"""``loongforge <command>`` as one process would run it, forked from the tests' fork server.

A command line run through ``subprocess`` starts a fresh interpreter that imports torch, megatron-core and
the command's code (about 5 s of CPU on the 2-core machine) before it does anything; the suite ran ~40 such
single-process commands (refused runs, ``encode``, ``profile``). Forked from the session's fork server
(``tests.models.helpers.run_workers``: those imports done once), the command runs in a process of its own
all the same: its own exit code, stdout, stderr and process state, nothing left in the pytest process.

What needs a real interpreter stays a subprocess: a command that launches its own ranks
(``--nproc-per-node``), a test of the environment a process starts with, or of a signal.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Sequence

from loongforge.cli.app import app
from tests.models.helpers import limit_threads, run_workers

TIMEOUT_S = 420


def run_cli(argv: Sequence[str], timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``loongforge *argv`` in one forked process: a CompletedProcess whose ``args`` is the command line a
    user would type, with the command's exit code, stdout and stderr."""
    with tempfile.TemporaryDirectory(prefix="loongforge-cli-") as logs:
        run_workers(_command_process, 1, (logs, list(map(str, argv))), timeout_s)
        read = lambda name: (Path(logs) / name).read_text()  # noqa: E731
        return subprocess.CompletedProcess([sys.executable, "-m", "loongforge.cli.app", *argv], int(read("code")),
                                           stdout=read("stdout"), stderr=read("stderr"))


def _command_process(rank: int, logs: str, argv: list[str]) -> None:
    """The forked process: stdout and stderr to files, the command, its exit code to ``logs/code``. An
    exception the command lets out is printed as Python would print it, exit code 1."""
    limit_threads()
    for stream, name in ((1, "stdout"), (2, "stderr")):
        with open(Path(logs) / name, "w") as log:
            os.dup2(log.fileno(), stream)  # the descriptor stays open as stdout / stderr
    code = 1
    try:
        app(args=argv, prog_name="loongforge")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        (Path(logs) / "code").write_text(str(code))
