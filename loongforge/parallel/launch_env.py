"""How many processes a launch has, from the environment and --nproc-per-node (no torch: the CLI
asks before it imports anything heavy, e.g. for a dry run)."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Mapping, MutableMapping

# Where the kernel hands out ports for bind(0) and outgoing connections; read once per process.
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LINUX_EPHEMERAL_RANGE = (32768, 60999)
_LOWEST_PORT = 10000
_PORT_TRIES = 200


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


def runs_on_cuda(device_preference: str) -> bool:
    """Whether ``training.device`` means CUDA on this machine (``auto``: when it has a CUDA device)."""
    if device_preference in ("cuda", "cpu"):
        return device_preference == "cuda"
    # lazy: this module stays torch-free for the CLI; only an ``auto`` run asks the machine
    import torch

    return torch.cuda.is_available()


def order_tensor_parallel_kernels(tensor_parallel: bool, env: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` for a run with tensor parallelism (any tower TP > 1),
    unless the launch chose a value; True when set. Must run before CUDA starts in the process.

    megatron-core's TP linears issue a collective and then the GEMM it should overlap, counting on a
    single hardware work queue to start them in that order; with CUDA's default of 8 queues the GEMM
    can start first and the communication runs exposed (megatron warns at its first linear). A
    launch that set its own value keeps it, and megatron's warning then says what it costs.
    """
    if not tensor_parallel or "CUDA_DEVICE_MAX_CONNECTIONS" in env:
        return False
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return True


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return _LINUX_EPHEMERAL_RANGE


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, chosen below the kernel's ephemeral range.

    Asking the kernel (bind to port 0) returns an ephemeral port and releases it: before the store
    binds it, any process's outgoing connection (gloo opens one per rank pair) or bind(0) may take
    it, and the store fails with EADDRINUSE. A port outside that range is only ever taken by a
    process that names it, so checking it is free here is enough.
    """
    low, _ = _ephemeral_port_range()
    candidates = range(_LOWEST_PORT, max(low, _LOWEST_PORT + _PORT_TRIES))
    chooser = random.SystemRandom()  # not the seeded global generator: concurrent runs would agree
    for port in chooser.sample(candidates, _PORT_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # all taken: the kernel's pick
        sock.bind((host, 0))
        return sock.getsockname()[1]
