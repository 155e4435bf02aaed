"""Sharded checkpoints: megatron-core ``dist_checkpointing`` for model and optimizer, plus per-rank state.

Layout of ``<dir>/step_00000100/``:
  ``model_optim/``      dist_checkpointing (torch_dist) files: model and optimizer, resharding-capable;
  ``rank_00003.pt``     this rank's RNG states, scheduler, data position and step counters;
  ``meta.json``         step, world layout, loongforge version (written last, by rank 0).
``<dir>/latest`` names the newest complete checkpoint. A checkpoint is written under ``*.tmp`` and
renamed only when every rank has finished, so a crash mid-save never leaves a checkpoint that looks
complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from loongforge import __version__
from loongforge.config.errors import InputError

LATEST_FILE = "latest"


@dataclass
class TrainState:
    step: int
    consumed_rows: int
    data_state: dict
    extra: dict


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _unwrap(chunk):
    """The bare model inside a DDP wrapper (keys without the wrapper's ``module.`` prefix)."""
    return getattr(chunk, "module", chunk)


def _sharded_state(model_chunks: list, optimizer, *, is_loading: bool) -> dict:
    model_sd = {"model": _unwrap(model_chunks[0]).sharded_state_dict()}
    if optimizer is not None:
        model_sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return model_sd


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(root: str | os.PathLike, state: TrainState, model_chunks: list, optimizer,
                    scheduler, *, layout: dict) -> Path:
    from megatron.core import dist_checkpointing

    root = Path(root)
    final_dir = root / step_dir_name(state.step)
    tmp_dir = root / (step_dir_name(state.step) + ".tmp")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        (tmp_dir / "model_optim").mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(_sharded_state(model_chunks, optimizer, is_loading=False),
                            str(tmp_dir / "model_optim"))
    torch.save({"step": state.step, "consumed_rows": state.consumed_rows,
                "data_state": state.data_state, "extra": state.extra,
                "scheduler": scheduler.state_dict(), "rng": _rng_state()},
               tmp_dir / f"rank_{rank:05d}.pt")
    _barrier()
    if rank == 0:
        (tmp_dir / "meta.json").write_text(json.dumps(
            {"step": state.step, "layout": layout, "loongforge": __version__}, indent=2))
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(tmp_dir, final_dir)
        (root / (LATEST_FILE + ".tmp")).write_text(final_dir.name)
        os.replace(root / (LATEST_FILE + ".tmp"), root / LATEST_FILE)
    _barrier()
    return final_dir


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint under ``root``, or None."""
    root = Path(root)
    marker = root / LATEST_FILE
    if marker.is_file():
        candidate = root / marker.read_text().strip()
        if (candidate / "meta.json").is_file():
            return candidate
    complete = sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file())
    return complete[-1] if complete else None


def load_checkpoint(path: str | os.PathLike, model_chunks: list, optimizer, scheduler) -> TrainState:
    """Restore model, optimizer, scheduler and RNG; return the step counters and data position."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "meta.json").is_file():
        raise InputError(f"{path}: not a complete loongforge checkpoint (no meta.json); "
                                "pass a step_* folder or the checkpoint root with --resume")
    loaded = dist_checkpointing.load(_sharded_state(model_chunks, optimizer, is_loading=True),
                                     str(path / "model_optim"))
    _unwrap(model_chunks[0]).load_state_dict(loaded["model"])
    if optimizer is not None and "optimizer" in loaded:
        optimizer.load_state_dict(loaded["optimizer"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rank_file = path / f"rank_{rank:05d}.pt"
    if not rank_file.is_file():  # a different world size: rank 0's counters are global anyway
        rank_file = path / "rank_00000.pt"
    per_rank = torch.load(rank_file, weights_only=False)
    # megatron's scheduler *adds* the saved step count to its current one: start from zero.
    scheduler.num_steps = 0
    scheduler.load_state_dict(per_rank["scheduler"])
    _set_rng_state(per_rank["rng"])
    return TrainState(step=per_rank["step"], consumed_rows=per_rank["consumed_rows"],
                      data_state=per_rank["data_state"], extra=per_rank["extra"])
