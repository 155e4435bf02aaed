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

import errno
import json
import os
import pickle
import random
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from loongforge import __version__
from loongforge.config.errors import InputError
from loongforge.convert.checkpoint_folders import (
    LATEST_FILE,
    LORA_BASE_KEY,
    META_FILE,
    MODEL_ONLY_KIND,
    checkpoint_candidates,
    step_dir_name,
)
from loongforge.models.hf.state_dict_names import is_adapter_key, is_lora_model, separate_name
from loongforge.parallel import mcore_patches
from loongforge.train.optim import continue_schedule, group_schedules


@dataclass
class TrainState:
    step: int
    consumed_rows: int
    data_state: dict
    extra: dict
    # A resume's LR-schedule settings that differ from the checkpoint's ("key old -> new"): the run
    # follows its config, and says so (optim.continue_schedule).
    schedule_changes: list = field(default_factory=list)


def _on_cuda(model_chunks: list) -> bool:
    """Whether the run computes on CUDA (read from its parameters, not from what is installed)."""
    return any(param.is_cuda for chunk in model_chunks for param in chunk.parameters())


def _rng_state(on_cuda: bool) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if on_cuda:
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = _cuda_tracker_states()
    return state


def _set_rng_state(state: dict, on_cuda: bool) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and on_cuda:
        torch.cuda.set_rng_state(state["cuda"])
    if "cuda_tracker" in state and on_cuda:
        _set_cuda_tracker_states(state["cuda_tracker"])


def _cuda_tracker():
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def _cuda_tracker_states() -> dict:
    """megatron's named CUDA RNG streams (model-parallel, expert-parallel, data-parallel): dropout
    inside tensor-parallel regions draws from them, not from the default CUDA generator, so a
    resume without them draws other masks."""
    return {name: (state.get_state() if isinstance(state, torch.Generator) else state.clone())
            for name, state in _cuda_tracker().get_states().items()}


def _set_cuda_tracker_states(saved: dict) -> None:
    tracker = _cuda_tracker()
    current = tracker.get_states()
    restored = {}
    for name, state in saved.items():
        if isinstance(current.get(name), torch.Generator):  # megatron's CUDA-graph-safe streams
            current[name].set_state(state)
            restored[name] = current[name]
        else:
            restored[name] = state.clone()
    tracker.set_states(restored)


def _unwrap(chunk):
    """The bare model inside a DDP wrapper (keys without the wrapper's ``module.`` prefix)."""
    return getattr(chunk, "module", chunk)


def _chunk_keys(model_chunks: list) -> list[str]:
    """The state dict's key of each model chunk: ``model``, or ``model0``, ``model1``, ... for the
    chunks of an interleaved pipeline (Megatron-LM's names). The tensors inside carry global keys
    and layer offsets, so a checkpoint does not depend on how the layers were chunked."""
    return ["model"] if len(model_chunks) == 1 else [f"model{index}" for index in range(len(model_chunks))]


def _model_sharded_state(model, saved_keys: Optional[set[str]]) -> dict:
    """One chunk's sharded entries: LoRA's adapters alone (the frozen base is rebuilt from where it
    came from, meta.json's ``lora_base``), fitted to the checkpoint's names when loading."""
    sharded = model.sharded_state_dict()
    if is_lora_model(model):
        sharded = {name: item for name, item in sharded.items() if is_adapter_key(name)}
    if saved_keys is not None:
        # Before the optimizer's entries are derived from the model's: they follow the renames.
        sharded = fit_to_checkpoint_names(sharded, saved_keys)
    return sharded


def _sharded_state(model_chunks: list, optimizer, *, is_loading: bool,
                   saved_keys: Optional[set[str]] = None) -> dict:
    """The model chunks (and optimizer) as dist_checkpointing describes them; ``saved_keys``
    (loading): the keys of the checkpoint, whose naming the model's entries are fitted to first."""
    model_sd = {key: _model_sharded_state(_unwrap(chunk), saved_keys)
                for key, chunk in zip(_chunk_keys(model_chunks), model_chunks)}
    if _holds_state(optimizer, model_chunks):
        # "fully_reshardable": the distributed optimizer's default format (fully_sharded_model_space)
        # cannot be written by megatron-core 0.16.1; this one also reshards across DP sizes.
        model_sd["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return model_sd


def _holds_state(optimizer, model_chunks: list) -> bool:
    """Whether this rank's optimizer has state to save and load: a pipeline stage with nothing to
    train (LoRA on the projector alone, training.freeze_language) has none, and its optimizer (empty,
    megatron-core's) describes none consistently with the other stages'. Decided by the stage's
    parameters, so every data-parallel rank of a stage agrees."""
    trains = any(param.requires_grad for chunk in model_chunks for param in chunk.parameters())
    return optimizer is not None and trains


def fit_to_checkpoint_names(sharded: dict, saved_keys: set[str]) -> dict:
    """Point a model's sharded entries at the names a checkpoint uses for them.

    Tensors: a checkpoint with separate-norm names (``input_layernorm.weight``; megatron's local spec
    and loongforge before the fused layout) is read by renaming our fused keys (``state_dict_names``).
    Objects (``_extra_state``: Transformer Engine's FP8 metadata, None elsewhere) that the checkpoint
    lacks, because another layer backend wrote it, are left out and keep their fresh values; a
    tensor the checkpoint lacks stays in, so dist_checkpointing names it as missing.
    """
    # lazy: this module imports no megatron-core until a run uses it
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
    """Every parameter and buffer from ``loaded`` (a LoRA model's adapters: its base is already in
    place); ``_extra_state`` entries the checkpoint did not have (see ``fit_to_checkpoint_names``)
    keep their fresh values."""
    result = model.load_state_dict(loaded, strict=False)
    adapters_only = is_lora_model(model)
    missing = [k for k in result.missing_keys
               if not k.endswith("_extra_state") and (is_adapter_key(k) or not adapters_only)]
    if missing or result.unexpected_keys:
        raise InputError(f"{path}: weights do not fit the model: missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}")


def _saved_keys(model_optim_dir: Path) -> set[str]:
    # lazy: this module imports no megatron-core until a run uses it
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


# meta.json's "layout" entry saying whether the optimizer state is the distributed optimizer's.
DISTRIBUTED_OPTIMIZER_KEY = "distributed_optimizer"
# The distributed optimizer saves its fp32 main parameters under this prefix (the plain one does not):
# how a checkpoint written before meta.json recorded the kind is told.
_DISTRIBUTED_STATE_PREFIX = "optimizer.state.param."


def saved_distributed_optimizer(path: Path) -> Optional[bool]:
    """Whether checkpoint ``path`` holds the distributed optimizer's state (True) or the plain
    optimizer's (False); None for one without optimizer state (``convert``'s, or a stage that
    trains nothing) or without meta.json (``load_checkpoint`` says what is missing)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        recorded = meta.get("layout", {}).get(DISTRIBUTED_OPTIMIZER_KEY)
        saved_keys = _saved_keys(path / "model_optim") if recorded is None and meta.get("kind") != MODEL_ONLY_KIND else set()
    except Exception:  # noqa: BLE001 - missing or damaged: the load says what (or skips it on --resume)
        return None
    if meta.get("kind") == MODEL_ONLY_KIND:
        return None
    if recorded is not None:
        return bool(recorded)
    optimizer_keys = [key for key in saved_keys if key.startswith("optimizer.")]
    if not optimizer_keys:
        return None
    return any(key.startswith(_DISTRIBUTED_STATE_PREFIX) for key in optimizer_keys)


def check_optimizer_kind(path: Path, setting: Optional[bool]) -> Optional[bool]:
    """The kind of optimizer state in checkpoint ``path`` (``saved_distributed_optimizer``), after
    checking that ``parallel.use_distributed_optimizer`` (``setting``; null follows the checkpoint)
    can load it: megatron-core reads each kind's state into its own kind only."""
    saved = saved_distributed_optimizer(path)
    if saved is None or setting is None or setting == saved:
        return saved
    raise InputError(f"{path}: its optimizer state is the {'distributed' if saved else 'plain'} optimizer's, which "
                     f"parallel.use_distributed_optimizer={str(setting).lower()} cannot load (megatron-core has no "
                     f"conversion between the two); leave it unset (null: the checkpoint's kind, at any DP size), or "
                     f"start a new stage from its weights (checkpoint.load={path} checkpoint.weights_only=true)")


def _gather_updated_weights(model_chunks: list) -> None:
    """With ``parallel.overlap_param_gather`` each rank updates only its shard of the weights, and
    a bucket's updated weights are all-gathered just before the next forward first uses them:
    until then the model holds the previous step's, which a checkpoint must not save. Gather all
    now (the next step gathers again, as always)."""
    for chunk in model_chunks:
        if getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False):
            chunk.start_param_sync(force_sync=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _local_bytes(model_chunks: list, optimizer) -> int:
    """Bytes of this rank's parameters and optimizer state: a lower bound of what a checkpoint
    adds to the disk (every rank's share is saved once, replicas by one rank only)."""
    tensors = [param for chunk in model_chunks for param in chunk.parameters()]
    for chained in getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else []):
        for state in getattr(getattr(chained, "optimizer", None), "state", {}).values():
            tensors += [value for value in state.values() if torch.is_tensor(value)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"


def _is_disk_full(error: BaseException, root: Path, needed: int) -> bool:
    """ENOSPC anywhere in the chain, or (torch's zip writer reports a short write as "unexpected
    pos", without the errno) less room left on the disk than this rank's share."""
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _error_chain(error)):
        return True
    return shutil.disk_usage(root).free < needed


def _error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every error behind it: causes, contexts, and the per-rank ``failures`` that
    torch.distributed.checkpoint collects (megatron re-raises those with ``from``)."""
    seen, todo = set(), [error]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__, *getattr(current, "failures", {}).values()]


def _gather_problems(problem: Optional[str]) -> list[str]:
    """Every rank's problem (None when fine), so that all ranks stop together or none does."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [problem] if problem else []
    gathered: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return [p for p in gathered if p]


def _space_problem(root: Path, needed: int) -> Optional[str]:
    free = shutil.disk_usage(root).free
    if free >= needed:
        return None
    return (f"cannot save a checkpoint under {root}: no space left on device (this rank's share needs "
            f"about {_megabytes(needed)}, {_megabytes(free)} free); free space or set checkpoint.dir")


def _write_shards(tmp_dir: Path, state: TrainState, model_chunks: list, optimizer, scheduler,
                  rank: int) -> None:
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core import dist_checkpointing

    # Writer threads, not megatron's forked writers and Manager process: nothing outlives a rank.
    with mcore_patches.scoped(mcore_patches.CHECKPOINT_SAVE_PATCHES):
        dist_checkpointing.save(_sharded_state(model_chunks, optimizer, is_loading=False),
                                str(tmp_dir / "model_optim"))
    torch.save({"step": state.step, "consumed_rows": state.consumed_rows,
                "data_state": state.data_state, "extra": state.extra,
                "scheduler": scheduler.state_dict(), "rng": _rng_state(_on_cuda(model_chunks))},
               tmp_dir / f"rank_{rank:05d}.pt")


def save_checkpoint(root: str | os.PathLike, state: TrainState, model_chunks: list, optimizer,
                    scheduler, *, layout: dict, record: Optional[dict] = None) -> Path:
    """Write ``<root>/step_N`` (see the module docstring). A full disk is an InputError naming the
    folder and the bytes needed, raised on every rank, with the partial ``.tmp`` removed.
    ``record``: more entries for ``meta.json``."""
    root = Path(root)
    final_dir = root / step_dir_name(state.step)
    tmp_dir = root / (step_dir_name(state.step) + ".tmp")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step_*.tmp"):  # left by a run that died mid-save; they hold disk space
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    needed = _local_bytes(model_chunks, optimizer)
    problems = _gather_problems(_space_problem(root, needed))  # before writing anything
    if problems:
        raise InputError(problems[0])
    if rank == 0:
        (tmp_dir / "model_optim").mkdir(parents=True)
    _barrier()
    error, disk_full = None, None
    _gather_updated_weights(model_chunks)
    try:
        _write_shards(tmp_dir, state, model_chunks, optimizer, scheduler, rank)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below
        error = exc
        if _is_disk_full(exc, root, needed):
            disk_full = (f"cannot save checkpoint {final_dir}: no space left on device (this rank's share "
                         f"needs about {_megabytes(needed)}, {_megabytes(shutil.disk_usage(root).free)} free); "
                         f"removed the partial {tmp_dir.name}; free space or set checkpoint.dir")
    # All ranks learn whether any failed: a rank that saved must not wait for one that did not.
    failures = _gather_problems(disk_full or (f"rank {rank}: {error!r}" if error is not None else None))
    if failures:
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # a partial checkpoint would keep the disk full
        full = [f for f in failures if f.startswith("cannot save")]
        if full:
            raise InputError(full[0])
        if error is not None:
            raise error
        raise RuntimeError(f"checkpoint {final_dir} not saved: {failures[0]}")
    if rank == 0:
        (tmp_dir / META_FILE).write_text(json.dumps(
            {"step": state.step, "layout": layout, "loongforge": __version__, **(record or {})}, indent=2))
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(tmp_dir, final_dir)
        (root / (LATEST_FILE + ".tmp")).write_text(final_dir.name)
        os.replace(root / (LATEST_FILE + ".tmp"), root / LATEST_FILE)
    _barrier()
    return final_dir


class DamagedCheckpoint(InputError):
    """A checkpoint folder whose files cannot be read back (truncated, empty, unparsable)."""


def _distcp_sizes_needed(model_optim: Path) -> dict[str, int]:
    """Bytes each ``.distcp`` file must hold, from the ``.metadata`` dist_checkpointing wrote."""
    # lazy: torch.distributed.checkpoint only to check a written checkpoint
    from torch.distributed.checkpoint import FileSystemReader

    needed: dict[str, int] = {}
    for info in FileSystemReader(str(model_optim)).read_metadata().storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed


def _check_file(path: Path, check) -> None:
    """Run ``check(path)``; any failure becomes a DamagedCheckpoint naming the file."""
    try:
        check(path)
    except Exception as exc:  # EOFError, UnpicklingError, RuntimeError, OSError, ...: all mean unreadable
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DamagedCheckpoint(f"{path}: unreadable ({detail})") from None


def _rank_file(path: Path) -> Path:
    """The per-rank state this rank restores from ``path``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    rank_file = path / f"rank_{rank:05d}.pt"
    # A different world size: rank 0's counters are global anyway, and a sharded data position is
    # dealt again from every rank's (saved_data_states).
    if not rank_file.is_file():
        rank_file = path / "rank_00000.pt"
    return rank_file


def saved_data_states(path: Path) -> list[dict]:
    """Every rank's saved data position in checkpoint ``path``, in rank order: a sharded read
    resumed at another data-parallel size deals them again (``DataPipeline.load_state_dict``)."""
    states = []
    for rank_file in sorted(path.glob("rank_*.pt")):
        _check_file(rank_file, lambda p: states.append(torch.load(p, weights_only=False)["data_state"]))
    return states


def saved_dp_size(path: Path) -> Optional[int]:
    """The data-parallel size checkpoint ``path`` was saved at (its meta.json), where recorded."""
    return json.loads((path / META_FILE).read_text()).get("layout", {}).get("dp")


def check_checkpoint_files(path: Path) -> None:
    """Raise DamagedCheckpoint naming the first file of checkpoint ``path`` that is unreadable or
    shorter than its index says. Cheap (sizes and the small pickles), so it runs before a load
    that would otherwise fail deep inside torch.distributed.checkpoint without naming the file."""
    model_optim = path / "model_optim"
    _check_file(path / META_FILE, lambda p: json.loads(p.read_text()))
    needed = {}
    _check_file(model_optim / ".metadata", lambda p: needed.update(_distcp_sizes_needed(p.parent)))
    for name, size in sorted(needed.items()):
        actual = (model_optim / name).stat().st_size if (model_optim / name).is_file() else None
        if actual is None or actual < size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise DamagedCheckpoint(f"{model_optim / name}: truncated ({found}, its index needs {size})")
    # Only the rank file this rank reads: at a thousand ranks, all of them on every rank add up.
    for pickle_file in [model_optim / "common.pt", _rank_file(path)]:
        if pickle_file.exists():
            _check_file(pickle_file, lambda p: torch.load(p, weights_only=False, map_location="cpu"))


def _expert_parallel_size(model_chunks: list) -> int:
    for module in _unwrap(model_chunks[0]).modules():
        if hasattr(module, "ep_group") and hasattr(module, "local_experts"):  # the experts of a MoE layer
            return module.ep_group.size()
    return 1


def _check_expert_parallel_size(path: Path, meta: dict, model_chunks: list) -> None:
    """Optimizer state loads only at the EP size it was saved at: megatron-core keeps one optimizer
    per kind of parameter under expert parallelism (prefixed ``chained_<n>.``) and one without, and
    its chained optimizer does not read the other's state. Weights alone reshard (through HF)."""
    saved, running = meta.get("layout", {}).get("ep", 1), _expert_parallel_size(model_chunks)
    if saved != running:
        raise InputError(f"{path} was saved at parallel.expert_model_parallel_size={saved}, this run has "
                         f"{running}: resume at {saved}, or start a new run from its weights (loongforge "
                         f"convert {path} HF_DIR --to hf, then checkpoint.load_hf=HF_DIR).")


def _damage(path: Path) -> Optional[str]:
    try:
        check_checkpoint_files(path)
    except DamagedCheckpoint as exc:
        return str(exc)
    return None


# What reading corrupt bytes raises (the size check catches truncation before any of these).
_UNREADABLE = (EOFError, pickle.UnpicklingError, zipfile.BadZipFile)


def _unreadable_cause(exc: BaseException) -> Optional[BaseException]:
    """The error inside ``exc`` (see ``_error_chain``) that says a file is unreadable, or None."""
    return next((e for e in _error_chain(exc)
                 if isinstance(e, _UNREADABLE) or "PytorchStreamReader failed" in str(e)), None)


def load_newest_checkpoint(root: str | os.PathLike, model_chunks: list, optimizer, scheduler
                           ) -> tuple[Path, TrainState, list[str]]:
    """Restore the newest checkpoint under ``root`` that loads (``--resume``).

    Damaged ones are skipped: a disk that filled up or a node that died mid-copy should cost the
    steps since the previous checkpoint, not the run. Returns the folder loaded, its state, and one
    reason per skipped checkpoint; raises InputError when none loads.
    """
    skipped = []
    for path in checkpoint_candidates(root):
        # Every rank skips a checkpoint any rank finds damaged; one alone would wait at a collective.
        damaged = _gather_problems(_damage(path))
        if damaged:
            skipped.append(damaged[0])
            continue
        try:
            return path, load_checkpoint(path, model_chunks, optimizer, scheduler), skipped
        except DamagedCheckpoint as exc:
            skipped.append(str(exc))  # names the folder and, where known, the file
    if not skipped:
        raise InputError(f"--resume: no complete checkpoint under {root}; run without --resume to start fresh")
    raise InputError(f"--resume: no checkpoint under {root} loads ({'; '.join(skipped)}); "
                     "run without --resume to start fresh")


def load_model_only(path: Path, model_chunks: list, optimizer) -> None:
    """Weights only, from a checkpoint ``loongforge convert --to mcore`` wrote (meta.json kind "model"),
    or a run's (``checkpoint.weights_only``).

    Such a checkpoint has no optimizer, scheduler, RNG or data state, and no megatron ``_extra_state``
    objects (FP8 metadata, empty without Transformer Engine): those keep their freshly built values.
    dist_checkpointing reshards the global tensors to this run's TP/PP layout.
    """
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    saved_keys = _saved_keys(path / "model_optim")
    for chunk in model_chunks:
        model = _unwrap(chunk)
        sharded = {k: v for k, v in model.sharded_state_dict().items() if not isinstance(v, ShardedObject)}
        sharded = fit_to_checkpoint_names(sharded, saved_keys)
        try:
            # No access-integrity check: it is a save-time guarantee, and with a vision TP of 1 under a
            # larger language TP the projector's replicas are all marked main (see the convert docs).
            loaded = dist_checkpointing.load(sharded, str(path / "model_optim"), validate_access_integrity=False)
        except Exception as exc:  # megatron raises several types; the message names the tensor
            raise InputError(f"{path}: cannot load the model weights: {exc}") from None
        loaded.pop("optimizer", None)  # a run's checkpoint: its common (unsharded) optimizer entries come along
        _load_weights(model, loaded, path)
    if optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # mixed precision keeps fp32 copies made at construction


def load_weights_only(path: str | os.PathLike, model_chunks: list, optimizer) -> int:
    """``checkpoint.weights_only``: the model weights of a loongforge checkpoint (a run's or
    ``convert``'s), resharded to this layout, and nothing else; returns the step they were saved at."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise InputError(f"{path}: not a complete loongforge checkpoint (no meta.json); pass a step_* folder")
    meta = json.loads((path / META_FILE).read_text())
    if meta.get(LORA_BASE_KEY):
        raise InputError(f"{path}: holds LoRA adapters alone, not the weights of a whole model; export the merged "
                         f"model (loongforge convert {path} DIR --to hf) and start the stage with "
                         f"checkpoint.load_hf=DIR")
    check_checkpoint_files(path)
    load_model_only(path, model_chunks, optimizer)
    return int(meta.get("step", 0))


def load_checkpoint(path: str | os.PathLike, model_chunks: list, optimizer, scheduler) -> TrainState:
    """Restore model, optimizer, scheduler and RNG; return the step counters and data position.

    Raises DamagedCheckpoint (an InputError naming the folder and, where known, the file) when the
    checkpoint's files cannot be read back."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise InputError(f"{path}: not a complete loongforge checkpoint (no meta.json); "
                                "pass a step_* folder or the checkpoint root with --resume")
    check_checkpoint_files(path)
    try:
        return _load_checked(path, model_chunks, optimizer, scheduler)
    except Exception as exc:
        damage = _unreadable_cause(exc)
        if damage is None:  # a mismatch or a bug, not damage: keep its own message and traceback
            raise
        raise DamagedCheckpoint(f"{path}: cannot be read back ({type(damage).__name__}: "
                                f"{str(damage).strip() or 'file ends early'})") from None


def _load_checked(path: Path, model_chunks: list, optimizer, scheduler) -> TrainState:
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core import dist_checkpointing

    meta = json.loads((path / META_FILE).read_text())
    if meta.get("kind") == MODEL_ONLY_KIND:
        load_model_only(path, model_chunks, optimizer)
        # data_state None: no data position to restore, the run starts at step 0
        return TrainState(step=0, consumed_rows=0, data_state=None, extra={})
    built_groups = group_schedules(scheduler.optimizer)  # the checkpoint's optimizer state replaces them
    if _holds_state(optimizer, model_chunks):
        _check_expert_parallel_size(path, meta, model_chunks)
        _init_optimizer_state(optimizer)
    with mcore_patches.scoped(mcore_patches.CHECKPOINT_LOAD_PATCHES):
        saved_keys = _saved_keys(path / "model_optim")
        loaded = dist_checkpointing.load(
            _sharded_state(model_chunks, optimizer, is_loading=True, saved_keys=saved_keys),
            str(path / "model_optim"))
        # A stage of a LoRA run with no adapter (LoRA on the projector alone) loads nothing.
        for key, chunk in zip(_chunk_keys(model_chunks), model_chunks):
            _load_weights(_unwrap(chunk), loaded.get(key, {}), path)
        if _holds_state(optimizer, model_chunks) and "optimizer" in loaded:
            optimizer.load_state_dict(loaded["optimizer"])
            _unshare_adam_steps(optimizer)
    per_rank = torch.load(_rank_file(path), weights_only=False)
    schedule_changes = continue_schedule(scheduler, per_rank["scheduler"], built_groups)
    _set_rng_state(per_rank["rng"], _on_cuda(model_chunks))
    return TrainState(step=per_rank["step"], consumed_rows=per_rank["consumed_rows"],
                      data_state=per_rank["data_state"], extra=per_rank["extra"], schedule_changes=schedule_changes)
