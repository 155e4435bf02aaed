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
from loongforge.models.state_dict_names import separate_name
from loongforge.parallel import mcore_patches

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


def _on_cuda(model_chunks: list) -> bool:
    """Whether the run computes on CUDA (read from its parameters, not from what is installed)."""
    return any(param.is_cuda for chunk in model_chunks for param in chunk.parameters())


def _rng_state(on_cuda: bool) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if on_cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict, on_cuda: bool) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and on_cuda:
        torch.cuda.set_rng_state(state["cuda"])


def _unwrap(chunk):
    """The bare model inside a DDP wrapper (keys without the wrapper's ``module.`` prefix)."""
    return getattr(chunk, "module", chunk)


def _sharded_state(model_chunks: list, optimizer, *, is_loading: bool,
                   saved_keys: Optional[set[str]] = None) -> dict:
    """The model (and optimizer) as dist_checkpointing describes them; ``saved_keys`` (loading): the
    keys of the checkpoint, whose naming the model's entries are fitted to first."""
    model_sd = {"model": _unwrap(model_chunks[0]).sharded_state_dict()}
    if saved_keys is not None:
        # Before the optimizer's entries are derived from the model's: they follow the renames.
        model_sd["model"] = fit_to_checkpoint_names(model_sd["model"], saved_keys)
    if optimizer is not None:
        # "fully_reshardable": the distributed optimizer's default format (fully_sharded_model_space)
        # cannot be written by megatron-core 0.16.1; this one also reshards across DP sizes.
        model_sd["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return model_sd


def fit_to_checkpoint_names(sharded: dict, saved_keys: set[str]) -> dict:
    """Point a model's sharded entries at the names a checkpoint uses for them.

    Tensors: a checkpoint with separate-norm names (``input_layernorm.weight``; megatron's local spec
    and loongforge before the fused layout) is read by renaming our fused keys (``state_dict_names``).
    Objects (``_extra_state``: Transformer Engine's FP8 metadata, None elsewhere) that the checkpoint
    lacks, because another layer backend wrote it, are left out and keep their fresh values; a
    tensor the checkpoint lacks stays in, so dist_checkpointing names it as missing.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    fitted = {}
    for name, item in sharded.items():
        if isinstance(item, ShardedObject):
            if item.key in saved_keys:
                fitted[name] = item
            continue
        if item.key not in saved_keys and separate_name(item.key) in saved_keys:
            item.key = separate_name(item.key)
        fitted[name] = item
    return fitted


def _load_weights(model, loaded: dict, path: Path) -> None:
    """Every parameter and buffer from ``loaded``; ``_extra_state`` entries the checkpoint did not
    have (see ``fit_to_checkpoint_names``) keep their fresh values."""
    result = model.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise InputError(f"{path}: weights do not fit the model: missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}")


def _saved_keys(model_optim_dir: Path) -> set[str]:
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return set(load_sharded_metadata(str(model_optim_dir)).keys())


def _init_optimizer_state(optimizer) -> None:
    """Create the (zero) optimizer state of every parameter, so the optimizer can describe the sharded
    layout it is about to load into; torch and TE/Apex Adam create state lazily at the first step.

    megatron-core's ``init_state_fn`` is the one made for the Adam it chose (torch, TE or Apex, with
    or without precision-aware state); SGD has none and needs none.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        init_state_fn = getattr(chained, "init_state_fn", None)
        inner = getattr(chained, "optimizer", None)
        if init_state_fn is None or inner is None:
            continue
        init_state_fn(inner, chained.config)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            # torch's Adam counts steps per parameter, in the state (TE's and Apex's keep the count
            # in the parameter groups); megatron's state_dict reads it while describing the layout.
            for param_state in inner.state.values():
                param_state.setdefault("step", torch.zeros((), dtype=torch.float32))


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
    # Writer threads, not megatron's forked writers and Manager process: nothing outlives a rank.
    with mcore_patches.scoped(mcore_patches.CHECKPOINT_SAVE_PATCHES):
        dist_checkpointing.save(_sharded_state(model_chunks, optimizer, is_loading=False),
                                str(tmp_dir / "model_optim"))
    torch.save({"step": state.step, "consumed_rows": state.consumed_rows,
                "data_state": state.data_state, "extra": state.extra,
                "scheduler": scheduler.state_dict(), "rng": _rng_state(_on_cuda(model_chunks))},
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
    sharded = fit_to_checkpoint_names(sharded, _saved_keys(path / "model_optim"))
    try:
        # No access-integrity check: it is a save-time guarantee, and with a vision TP of 1 under a
        # larger language TP the projector's replicas are all marked main (see the convert docs).
        loaded = dist_checkpointing.load(sharded, str(path / "model_optim"), validate_access_integrity=False)
    except Exception as exc:  # megatron raises several types; the message names the tensor
        raise InputError(f"{path}: cannot load the model weights: {exc}") from None
    _load_weights(model, loaded, path)
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
        _init_optimizer_state(optimizer)
    with mcore_patches.scoped(mcore_patches.CHECKPOINT_LOAD_PATCHES):
        saved_keys = _saved_keys(path / "model_optim")
        loaded = dist_checkpointing.load(
            _sharded_state(model_chunks, optimizer, is_loading=True, saved_keys=saved_keys),
            str(path / "model_optim"))
        _load_weights(_unwrap(model_chunks[0]), loaded["model"], path)
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
    _set_rng_state(per_rank["rng"], _on_cuda(model_chunks))
    return TrainState(step=per_rank["step"], consumed_rows=per_rank["consumed_rows"],
                      data_state=per_rank["data_state"], extra=per_rank["extra"])
