"""The default process group's backend follows the run's device and carries what each step sends."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.distributed.distributed_c10d import BackendConfig

from loongforge.config.errors import ConfigError
from loongforge.parallel.distributed import process_group_backend, resolve_device


def test_a_cuda_run_gets_gloo_for_cpu_tensors_and_nccl_for_cuda_tensors():
    """Per-step bookkeeping (loss/token totals, sync-wait spread) all-reduces CPU tensors; NCCL alone
    refuses them, so the CUDA run's default group maps each device type to its own backend."""
    mapping = BackendConfig(process_group_backend(torch.device("cuda", 0))).get_device_backend_map()
    assert mapping == {"cpu": "gloo", "cuda": "nccl"}


def test_a_cpu_run_is_gloo_only():
    assert BackendConfig(process_group_backend(torch.device("cpu"))).get_device_backend_map()["cpu"] == "gloo"


def test_cuda_without_a_gpu_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="training.device=cuda but this machine has no usable CUDA device"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


def test_the_cpu_group_all_reduces_cpu_tensors():
    """A fresh process: init_distributed for a CPU run, then the step's CPU collective."""
    code = (
        "import torch, torch.distributed as dist\n"
        "from loongforge.parallel.distributed import init_distributed\n"
        "env = init_distributed('cpu')\n"
        "x = torch.tensor([1.5, 2.0], dtype=torch.float64)\n"
        "dist.all_reduce(x)\n"
        "print(env.backend, dist.get_backend(), x.tolist())\n"
        "dist.destroy_process_group()\n"
    )
    env = {"PATH": "", "PYTHONHASHSEED": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["gloo", "gloo", "[1.5,", "2.0]"]
