"""This process's multiprocessing fork server, preloaded: import once, fork many.

A spawned process is a fresh interpreter: every training rank imported torch, megatron-core and the
model code itself (seconds of CPU each, all ranks of a node at once). A fork server imports them
once, before it serves the first request, and forks each process from that state.

Python keeps one fork server per process (``multiprocessing.forkserver``); whatever starts processes
through ``multiprocessing.get_context("forkserver")`` (torch's elastic agent and
``torch.multiprocessing.start_processes`` with ``start_method="forkserver"``) uses it. This module
starts it with the modules to preload and stops it; the rest is CPython's:

* the server's children inherit its environment as it was when it started (``start`` therefore
  stops a server started earlier), and its warning filters;
* the preload resolves against the server's own ``sys.path`` (the working directory, PYTHONPATH,
  site-packages): CPython up to 3.13 passes the starter's path to the server but does not apply it.
  A module it cannot import is skipped; a child then imports it itself after the start-up, as a
  spawned one would;
* the server exits when the last holder of its "alive" pipe closes it: the starter and, handed a
  copy each, every child. ``release_alive_pipe`` (in a child) makes the server's life the starter's
  alone, so that a server, and the children tied to it (``die_with_parent``), end when the starter
  dies. It reads that pipe only once it has imported its preload (seconds), so the server started
  here also asks the kernel to kill it when its starter dies (``fork_server_preamble``, imported
  first).

CPython keeps the server's state private (``forkserver._forkserver``, the same since 3.4): it is
read and reset here and nowhere else.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from multiprocessing import forkserver
from typing import Sequence

__all__ = ["start", "ensure", "stop", "pid", "release_alive_pipe", "die_with_parent"]

PREAMBLE = "loongforge.parallel.fork_server_preamble"
# Imported after the preload: freezes its objects out of the children's garbage collections.
POSTAMBLE = "loongforge.parallel.fork_server_frozen"
# The pid of the process that started the server, for the preamble (set only while it starts).
STARTER_ENV = "LOONGFORGE_FORK_SERVER_STARTER"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when ``parent_pid`` (its parent) exits, however it exits.

    Linux only (prctl through libc); returns False where that is not available. A parent that died
    before the request took effect is caught by comparing the parent pid afterwards. The parent is
    the thread that forked this process: call it in a process forked by a thread that outlives it.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:
        os._exit(128 + signal.SIGKILL)  # orphaned already: nobody is left to collect our work
    return True


def pid() -> int | None:
    """The running server's pid, as the process that started it knows it; None elsewhere."""
    return forkserver._forkserver._forkserver_pid


def start(preload: Sequence[str]) -> int:
    """A fork server started now (a running one is stopped first) that imports ``preload`` before it
    forks anything; its pid. Its children get this process's environment of now. Call it from the
    main thread: the server dies with the thread that started it."""
    stop()
    multiprocessing.get_context("forkserver").set_forkserver_preload([PREAMBLE, *preload, POSTAMBLE])
    # The server's preamble ties it to this pid: its own getppid() would already name init if this
    # process died before the preamble ran (a kill -9 while the server starts up, on a loaded node).
    previous = os.environ.get(STARTER_ENV)
    os.environ[STARTER_ENV] = str(os.getpid())
    try:
        forkserver.ensure_running()  # returns at once: the server imports while requests queue up
    finally:
        if previous is None:
            os.environ.pop(STARTER_ENV, None)
        else:
            os.environ[STARTER_ENV] = previous
    return pid()


def ensure(preload: Sequence[str]) -> int:
    """The running server when it was started with ``preload`` (restarted by CPython if it died),
    else a new one."""
    if pid() is None or forkserver._forkserver._preload_modules != [PREAMBLE, *preload, POSTAMBLE]:
        return start(preload)
    forkserver.ensure_running()
    return pid()


def stop() -> None:
    """End the server this process started, if any; its children tied to it (PDEATHSIG) end too."""
    server_pid = pid()
    if server_pid is None:
        return
    try:
        # Killed rather than asked: a child that still holds the alive pipe would keep it waiting.
        os.kill(server_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    forkserver._forkserver._stop()  # closes this side of the pipe and reaps the server


def release_alive_pipe() -> None:
    """In a child of the fork server: close this child's copy of the server's alive pipe (see the
    module docstring). Does nothing in the starter, which has the server's pid, nor in a spawned
    process, which has no pipe."""
    server = forkserver._forkserver
    if server._forkserver_pid is None and server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
