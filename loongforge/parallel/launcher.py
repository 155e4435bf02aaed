"""Starting training processes: in this process, or N local workers via torch's elastic launcher.

Three ways a run starts, one rule each:

* ``loongforge train --nproc-per-node N`` (N > 1) outside any launcher: this process becomes the
  elastic agent and spawns N workers on this node (rendezvous on 127.0.0.1, a free port); each
  worker calls ``run_training``.
* under ``torchrun`` or SLURM (``RANK``/``WORLD_SIZE`` or ``SLURM_PROCID``/``SLURM_NTASKS`` set):
  the launcher already made the processes, so this one just trains; the runner initialises the
  process group from those variables.
* otherwise: one process trains.

torch is imported inside functions so that ``loongforge --help`` does not pay for it.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Callable, Mapping

from loongforge.config.schema import RunConfig


# entrypoint(cfg, resume, command_line), run once per worker.
WorkerEntrypoint = Callable[[RunConfig, bool, list[str]], None]


class LaunchError(RuntimeError):
    """Worker processes failed; their own tracebacks were printed above this message."""


def external_launch_world_size(env: Mapping[str, str] = os.environ) -> int | None:
    """The world size an external launcher (torchrun, SLURM) set up, or None outside one."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_NTASKS"])
    return None


def resolve_world_size(nproc_per_node: int | None,
                       env: Mapping[str, str] = os.environ) -> int | None:
    """The launch's process count: the external launcher's, else --nproc-per-node, else None.

    None means "no launch information": validation then uses the config's parallel.world_size.
    """
    external = external_launch_world_size(env)
    if external is not None:
        return external
    return nproc_per_node


def needs_local_workers(nproc_per_node: int | None, env: Mapping[str, str] = os.environ) -> bool:
    return (nproc_per_node or 1) > 1 and external_launch_world_size(env) is None


def run_training_worker(cfg: RunConfig, resume: bool, command_line: list[str]) -> None:
    """Entry point of one worker (module level so the spawn start method can pickle it)."""
    from loongforge.train.runner import run_training

    run_training(cfg, resume=resume, command_line=command_line)


def _free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local_workers(cfg: RunConfig, *, nproc_per_node: int, resume: bool,
                         command_line: list[str],
                         entrypoint: WorkerEntrypoint = run_training_worker) -> None:
    """Run ``entrypoint(cfg, resume, command_line)`` in ``nproc_per_node`` spawned workers.

    Blocks until all workers finish; raises LaunchError naming the failed ranks. No restarts: a
    crashed training step fails the same way again, and --resume is the recovery path.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=f"loongforge-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_local_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    try:
        elastic_launch(launch_config, entrypoint)(cfg, resume, command_line)
    except ChildFailedError as exc:
        failed = ", ".join(f"rank {rank} (exit code {failure.exitcode})"
                           for rank, failure in sorted(exc.failures.items()))
        raise LaunchError(f"training workers failed: {failed}") from exc


def run(cfg: RunConfig, *, nproc_per_node: int | None, resume: bool,
        command_line: list[str]) -> None:
    """Train with the process layout the environment and ``--nproc-per-node`` ask for."""
    if needs_local_workers(nproc_per_node):
        launch_local_workers(cfg, nproc_per_node=nproc_per_node or 1, resume=resume,
                             command_line=command_line)
    else:
        run_training_worker(cfg, resume, command_line)
