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
# meta.json "kind" of a weights-only checkpoint (written by `loongforge convert --to mcore`).
MODEL_ONLY_KIND = "model"


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
        # "fully_reshardable": the distributed optimizer's default format (fully_sharded_model_space)
        # cannot be written by megatron-core 0.16.1; this one also reshards across DP sizes.
        model_sd["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return model_sd


def _init_optimizer_state(optimizer) -> None:
    """Create empty Adam state (moments and step) for every parameter, so the optimizer can describe
    the sharded layout it is about to load into; torch creates state lazily at the first step."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if inner is None or not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param.data)
                    state["exp_avg_sq"] = torch.zeros_like(param.data)


def _fix_distributed_optimizer_state_restore() -> None:
    """megatron-core 0.16.1 restores distributed-optimizer state (without TE/Apex) by ``copy_`` into
    leaf tensors that require grad, and also into Adam's ``step`` entry, which the checkpoint does
    not carry: both raise. Copy under no_grad and only the keys the checkpoint has."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_loongforge_fixed", False):
        return

    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destinations = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for key, source in tensors.items():
                if key in destinations and torch.is_tensor(destinations[key]):
                    destinations[key].copy_(source)

    set_states._loongforge_fixed = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _unshare_adam_steps(optimizer) -> None:
    """megatron-core's distributed optimizer restores Adam's ``step`` as ONE tensor shared by every
    parameter; torch then increments it once per parameter per update. Give each its own copy."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


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


def load_model_only(path: Path, model_chunks: list, optimizer) -> None:
    """Weights only, from a checkpoint ``loongforge convert --to mcore`` wrote (meta.json kind "model").

    Such a checkpoint has no optimizer, scheduler, RNG or data state, and no megatron ``_extra_state``
    objects (FP8 metadata, empty without Transformer Engine): those keep their freshly built values.
    dist_checkpointing reshards the global tensors to this run's TP/PP layout.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model = _unwrap(model_chunks[0])
    sharded = {k: v for k, v in model.sharded_state_dict().items() if not isinstance(v, ShardedObject)}
    try:
        # No access-integrity check: it is a save-time guarantee, and with a vision TP of 1 under a
        # larger language TP the projector's replicas are all marked main (see the convert docs).
        loaded = dist_checkpointing.load(sharded, str(path / "model_optim"), validate_access_integrity=False)
    except Exception as exc:  # megatron raises several types; the message names the tensor
        raise InputError(f"{path}: cannot load the model weights: {exc}") from None
    result = model.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise InputError(f"{path}: weights do not fit the model: missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}")
    if optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # mixed precision keeps fp32 copies made at construction


def load_checkpoint(path: str | os.PathLike, model_chunks: list, optimizer, scheduler) -> TrainState:
    """Restore model, optimizer, scheduler and RNG; return the step counters and data position."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "meta.json").is_file():
        raise InputError(f"{path}: not a complete loongforge checkpoint (no meta.json); "
                                "pass a step_* folder or the checkpoint root with --resume")
    if json.loads((path / "meta.json").read_text()).get("kind") == MODEL_ONLY_KIND:
        load_model_only(path, model_chunks, optimizer)
        # data_state None: no data position to restore, the run starts at step 0
        return TrainState(step=0, consumed_rows=0, data_state=None, extra={})
    if optimizer is not None:
        _fix_distributed_optimizer_state_restore()
        _init_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(_sharded_state(model_chunks, optimizer, is_loading=True),
                                     str(path / "model_optim"))
    _unwrap(model_chunks[0]).load_state_dict(loaded["model"])
    if optimizer is not None and "optimizer" in loaded:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
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
