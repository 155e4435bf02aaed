"""Starting training processes: in this process, or N local workers via torch's elastic launcher.

Three ways a run starts, one rule each:

* ``loongforge train --nproc-per-node N`` (N > 1) outside any launcher: this process becomes the
  elastic agent and starts N workers on this node (rendezvous on 127.0.0.1, a free port); each
  worker calls ``run_training``. The workers are forked by a fork server (``parallel.fork_server``)
  that this launch starts first and that imports the training code once, while the agent sets up
  the rendezvous: a worker starts with torch, megatron-core and the model code imported, instead
  of importing them itself as a spawned interpreter would (N at once on the node's cores).
* under ``torchrun`` or SLURM (``RANK``/``WORLD_SIZE`` or ``SLURM_PROCID``/``SLURM_NTASKS`` set):
  the launcher already made the processes, so this one just trains; the runner initialises the
  process group from those variables.
* otherwise: one process trains.

Stopping: a run stopped by SIGTERM or SIGINT (see ``loongforge.train.stop``) exits with 143 or 130
from every process. The local launcher forwards those signals to its workers (torch's elastic agent
does), gives them ``parallel.collective_timeout_s`` to finish the step and save, and exits with the
workers' code. Nothing outlives the launcher, even under kill -9: the fork server exits when the
launcher does (CPython's server exits at the end of its "alive" pipe, which only the launcher then
holds), each worker asks the kernel to kill it when the server, its parent, dies
(``PR_SET_PDEATHSIG``), and a worker whose peer dies fails in its next collective (gloo reports the
closed connection), which makes the agent stop the others. A worker's environment is the
launcher's at the launch (the server is started by it) plus the agent's per-rank variables
(``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...), which torch sets in the worker before it runs.

How many processes a launch has is ``parallel.launch_env``'s (torch-free, for the CLI).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import shutil
import signal
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Callable, Iterator

from loongforge.config.errors import ConfigError, InputError, LaunchError
from loongforge.config.schema import RunConfig
from loongforge.models.family import LazyFunction
from loongforge.parallel import fork_server
from loongforge.parallel.console import filter_known_warnings
from loongforge.parallel.fork_server import die_with_parent
from loongforge.parallel.launch_env import free_port, needs_local_workers, runs_on_cuda

# entrypoint(cfg, resume, command_line), run once per worker.
WorkerEntrypoint = Callable[[RunConfig, bool, list[str]], None]

# Training, imported by the workers' fork server: the launcher itself never loads megatron-core and
# the model code (seconds of CPU, while the server imports the same for the workers).
run_training_worker = LazyFunction("loongforge.train.runner:run_training_worker")


# Exit codes of a worker stopped by SIGINT or SIGTERM: 130/143 (128 + signal, a run stopped at a step
# boundary) or -2/-15 (killed by the signal before it could install its handlers, at start-up).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_EXIT_CODES = frozenset([128 + sig for sig in _STOP_SIGNALS] + [-sig for sig in _STOP_SIGNALS])
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


# A worker's exit code for a usage problem (bad config or input) it met after start-up; its message
# is in the launch's usage folder, for the launcher to report as one line (only cli/ prints).
USAGE_EXIT_CODE = 2


def _tie_to_launcher(launcher_pid: int, server_pid: int) -> None:
    """Die with the launcher, however it dies: the kernel kills this worker when the fork server,
    its parent, exits, and the server exits when the launcher does once no worker holds its alive
    pipe. A launcher gone before the tie took effect is caught by asking after it."""
    fork_server.release_alive_pipe()
    die_with_parent(server_pid)
    try:
        os.kill(launcher_pid, 0)
    except ProcessLookupError:
        os._exit(128 + signal.SIGKILL)  # orphaned already: nobody is left to collect our work


def _local_worker(entrypoint: WorkerEntrypoint, launcher_pid: int, server_pid: int, usage_dir: str,
                  cfg: RunConfig, resume: bool, command_line: list[str]) -> None:
    """A forked worker: tied to the launcher's life, then the entrypoint."""
    _tie_to_launcher(launcher_pid, server_pid)
    filter_known_warnings(cfg.logging.verbose, on_cuda=runs_on_cuda(cfg.training.device))
    try:
        entrypoint(cfg, resume, command_line)
    except (ConfigError, InputError) as exc:
        # Found inside a worker (every sample of a shard rejected, a checkpoint that does not load):
        # the message travels to the launcher instead of a traceback per rank.
        (Path(usage_dir) / f"rank_{os.environ.get('RANK', '0')}.txt").write_text(str(exc))
        raise SystemExit(USAGE_EXIT_CODE) from None


def _usage_problem(usage_dir: Path) -> str | None:
    """The first usage message a worker left (lowest rank), or None."""
    messages = sorted(usage_dir.glob("rank_*.txt"), key=lambda p: int(p.stem.split("_")[1]))
    return messages[0].read_text() if messages else None


# Imported by every training rank while it sets up, lazily (importing the runner stays light for
# whatever else imports it): the workers' fork server imports them once for all ranks.
_TRAINING_SET_UP_IMPORTS = (
    "torch._dynamo",  # torch.optim's add_param_group imports it when the optimizer is built
    "transformers",  # the data pipeline's tokenizer
)


def _worker_preload(entrypoint: WorkerEntrypoint, cfg: RunConfig) -> list[str]:
    """What the workers' fork server imports: the entrypoint's module and this one (the worker
    function's), after the warning filters a worker would install before importing megatron-core;
    for training, also what each rank would import while it sets up."""
    module = entrypoint.path.partition(":")[0] if isinstance(entrypoint, LazyFunction) else entrypoint.__module__
    preload = ([] if cfg.logging.verbose else ["loongforge.parallel.quiet_known_warnings"]) + [__name__, module]
    if entrypoint is run_training_worker:
        preload += [*_TRAINING_SET_UP_IMPORTS, *(["datasets"] if cfg.data.source == "files" else [])]
    return preload


def _warm_failure_logging() -> None:
    """torch's log formatter imports torch._dynamo the first time it formats an exception (1-2 s,
    several on a loaded machine), and that first time is the agent reporting a failed worker: the
    launcher, and with it the job, would linger after the failure. Importing it in the background
    while the workers start takes that cost off the failure path."""
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True,
                     name="loongforge-warm-logging").start()


@contextlib.contextmanager
def worker_server_started(cfg: RunConfig, *, nproc_per_node: int | None,
                          entrypoint: WorkerEntrypoint = run_training_worker) -> Iterator[None]:
    """When this run launches local workers, their fork server starts now and imports the training
    code while the body runs (the CLI's checks); ``launch_local_workers`` then forks the workers from
    it. Stopped again when the body raises: a refused run starts nothing."""
    if needs_local_workers(nproc_per_node):
        fork_server.start(_worker_preload(entrypoint, cfg))
    try:
        yield
    except BaseException:
        fork_server.stop()
        raise


def _launch_config(cfg: RunConfig, nproc_per_node: int):
    """One node, a free local port, no restarts, workers forked by the fork server."""
    # lazy: a run in this process (under torchrun, or one process) needs no elastic launcher
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=f"loongforge-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        start_method="forkserver",
        # After a SIGTERM/SIGINT the agent forwards it and waits this long for the workers to finish
        # the step and save before it kills them; a longer wait would be a hung collective anyway.
        shutdown_timeout=cfg.parallel.collective_timeout_s,
    )


def _raise_worker_failure(error: Exception, usage_dir: Path) -> None:
    """The exit of a launch whose workers failed (``error``: torch's ChildFailedError)."""
    failures = error.failures  # rank -> ProcessFailure
    codes = {failure.exitcode for failure in failures.values()}
    if codes <= STOP_EXIT_CODES:  # the workers were signalled and stopped
        raise SystemExit(128 + max(code - 128 if code > 0 else -code for code in codes)) from None
    # A usage problem in any worker is the cause: peers then fail on the closed connection.
    if USAGE_EXIT_CODE in codes and (message := _usage_problem(usage_dir)) is not None:
        raise InputError(message) from None
    failed = ", ".join(f"rank {rank} (exit code {failure.exitcode})" for rank, failure in sorted(failures.items()))
    raise LaunchError(f"training workers failed: {failed}") from error


def launch_local_workers(cfg: RunConfig, *, nproc_per_node: int, resume: bool,
                         command_line: list[str],
                         entrypoint: WorkerEntrypoint = run_training_worker) -> None:
    """Run ``entrypoint(cfg, resume, command_line)`` in ``nproc_per_node`` forked workers.

    Blocks until all workers finish; raises LaunchError naming the failed ranks. No restarts: a
    crashed training step fails the same way again, and --resume is the recovery path.
    """
    # lazy: a run in this process (under torchrun, or one process) needs no elastic launcher
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # First (unless start_worker_server did): the server imports the training code while the agent
    # sets up the rendezvous.
    server_pid = fork_server.ensure(_worker_preload(entrypoint, cfg))
    usage_dir = Path(tempfile.mkdtemp(prefix="loongforge-usage-"))
    # torch's elastic agent installs its own SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers and leaves them:
    # restored below, so a process that launched workers (a test, a notebook) and later forks does
    # not pass a handler that outlives its purpose to the children.
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    try:
        launch_config = _launch_config(cfg, nproc_per_node)
        _warm_failure_logging()
        # Named after the entrypoint: the elastic agent reports failures by the function's name.
        worker = functools.partial(_local_worker, entrypoint, os.getpid(), server_pid, str(usage_dir))
        worker.__name__ = worker.__qualname__ = entrypoint.__name__
        elastic_launch(launch_config, worker)(cfg, resume, command_line)
    except SignalException as exc:  # this process was signalled; the workers have stopped
        raise SystemExit(128 + int(exc.sigval)) from None
    except ChildFailedError as exc:
        _raise_worker_failure(exc, usage_dir)
    finally:
        fork_server.stop()  # a later launch or fork in this process starts from its own state
        shutil.rmtree(usage_dir, ignore_errors=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def run(cfg: RunConfig, *, nproc_per_node: int | None, resume: bool,
        command_line: list[str]) -> None:
    """Train with the process layout the environment and ``--nproc-per-node`` ask for."""
    if needs_local_workers(nproc_per_node):
        launch_local_workers(cfg, nproc_per_node=nproc_per_node or 1, resume=resume,
                             command_line=command_line)
    else:
        filter_known_warnings(cfg.logging.verbose, on_cuda=runs_on_cuda(cfg.training.device))
        run_training_worker(cfg, resume, command_line)
