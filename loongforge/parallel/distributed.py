"""Process-group set-up: torch.distributed from the launch environment, then megatron-core's groups.

Three launch styles reach the same state:
* ``loongforge train --nproc-per-node N`` (our elastic launcher) and an external ``torchrun`` both set
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``;
* a SLURM allocation (``srun loongforge train ...``) sets ``SLURM_PROCID``/``SLURM_NTASKS``/
  ``SLURM_LOCALID``; the master address is the first host of the allocation (or ``MASTER_ADDR``);
* a plain single process gets a world of one on 127.0.0.1 with a free port.
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from loongforge.config.errors import ConfigError
from loongforge.config.layout import expert_tensor_parallel_size
from loongforge.config.pipeline_layout import megatron_virtual_stages
from loongforge.config.schema import ParallelConfig
from loongforge.parallel.launch_env import free_port, runs_on_cuda


@dataclass(frozen=True)
class DistributedEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # Launch variables this process set itself (a plain single process); shutdown removes them so
    # that a later run in the same process reads its own launch, not this one's.
    added_env: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the TP x CP x PP x DP grid (megatron-core's groups hold the
    communicators). The CP ranks of one data-parallel replica read the same rows."""

    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_size: int = 1
    cp_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def all_gather_tensor():
    """``dist.all_gather_single`` (torch 2.13's name), or ``all_gather_into_tensor`` where torch is
    older: the old name is deprecated where the new one exists."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_tensor():
    """``dist.reduce_scatter_single`` (torch 2.13's name), or ``reduce_scatter_tensor`` where older."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _slurm_master_addr() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                             capture_output=True, text=True).stdout.split()
        return out[0]
    except (OSError, subprocess.CalledProcessError):
        return nodelist.split(",")[0]


def _launch_env_from_slurm() -> None:
    """Translate SLURM's task variables into the torch.distributed ones, unless a launcher set them."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
    # A port derived from the job id so every task of the job agrees without talking first.
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def resolve_device(preference: str) -> torch.device:
    """``training.device`` -> the device this run computes on (``auto``: CUDA when there is one)."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device=cuda but this machine has no usable CUDA device "
                          "(torch.cuda.is_available() is False); use training.device=cpu or auto")
    return torch.device("cuda") if runs_on_cuda(preference) else torch.device("cpu")


_LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def process_group_backend(device: torch.device) -> str:
    """The default group's backend for a run on ``device``.

    A CUDA run's collectives move CUDA tensors (gradients, pipeline activations) over NCCL, and its
    per-step bookkeeping (loss and token totals, sync-wait spread) moves small CPU tensors; an
    NCCL-only group refuses those ("No backend type associated with device type cpu"), so the
    group carries both: gloo for CPU tensors, NCCL for CUDA ones. A CPU run is gloo only.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_distributed(device_preference: str = "auto", timeout_s: int = 600) -> DistributedEnv:
    """Initialise the default process group (see ``process_group_backend``) from the launch
    environment; a collective waiting longer than ``timeout_s`` for another rank fails
    (``parallel.collective_timeout_s``)."""
    launched = {key for key in _LAUNCH_KEYS if key in os.environ}
    _launch_env_from_slurm()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = resolve_device(device_preference)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    backend = process_group_backend(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    added = tuple(key for key in _LAUNCH_KEYS if key not in launched)
    return DistributedEnv(rank, world_size, local_rank, device, backend, added_env=added)


def init_model_parallel(parallel_cfg: ParallelConfig, *, seed: int, device: torch.device) -> ParallelLayout:
    """Create megatron-core's TP/CP/PP/DP groups and seed every RNG so TP ranks agree."""
    # lazy: the launcher (preflight) imports this module without megatron-core
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=megatron_virtual_stages(parallel_cfg),
            context_parallel_size=parallel_cfg.context_parallel_size,
            expert_model_parallel_size=parallel_cfg.expert_model_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size(parallel_cfg),
            # megatron's groups take whole minutes; its default is torch's 30.
            distributed_timeout_minutes=max(1, math.ceil(parallel_cfg.collective_timeout_s / 60)),
        )
    layout = ParallelLayout(
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        pp_size=mpu.get_pipeline_model_parallel_world_size(),
        dp_size=mpu.get_data_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        cp_size=mpu.get_context_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(),
    )
    # One seed on every rank. The initial weights do not come from this stream: the model draws
    # them from keys of (seed, global name), the same at every TP/PP layout (models.layers.initialization).
    seed_everything(seed)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        # The CUDA RNG tracker cannot be created on CPU; this form falls back to the CPU generator
        # (dropout masks are then identical across TP ranks, which is correct for replicated regions).
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True,
                                                        force_reset_rng=True)
    return layout


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def shutdown(env: DistributedEnv | None = None) -> None:
    """Destroy megatron's and torch's groups; with ``env``, also remove the launch variables
    ``init_distributed`` set for it."""
    # lazy: the launcher (preflight) imports this module without megatron-core
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    for key in env.added_env if env is not None else ():
        os.environ.pop(key, None)
