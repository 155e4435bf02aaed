"""What ``loongforge train`` checks before it starts processes, builds a model or writes a file.

Each check here used to fail late (after the model was built, as a traceback) or not at all:

* the data files exist and hold something (the same rule ``pack`` applies to its inputs), and a
  tokenizer folder holds a tokenizer (else one line naming what to download);
* ``training.device`` exists on this machine;
* the run folder belongs to one run. A fresh run into a folder that holds another run's
  checkpoints would replace same-numbered ``step_*`` folders, keep the higher ones (which a later
  ``--resume`` would continue under the new config) and append to ``metrics.jsonl``. Such a
  folder is refused, or with ``--overwrite`` moved aside whole, never deleted.
"""

from __future__ import annotations

import time
from pathlib import Path

from loongforge.config.data_sets import named_sets
from loongforge.config.errors import InputError
from loongforge.config.schema import RunConfig
from loongforge.data.conversations import expand_data_paths
from loongforge.data.tokenizer import check_tokenizer
from loongforge.models.registry import check_family_layout
from loongforge.parallel.distributed import resolve_device
from loongforge.train.metrics import METRICS_FILE


def checkpoint_root(cfg: RunConfig) -> Path:
    """Where this run saves and finds checkpoints: ``checkpoint.dir``, else ``<output_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir or Path(cfg.logging.output_dir) / "checkpoints")


def check_can_start(cfg: RunConfig, *, resume: bool, overwrite: bool) -> None:
    """Every check that needs no process group; raises InputError/ConfigError naming the key."""
    check_family_layout(cfg)
    check_data(cfg)
    resolve_device(cfg.training.device)
    _check_folders(cfg)
    if not resume and not overwrite:
        _check_unused(cfg)


def check_data(cfg: RunConfig) -> None:
    """Data files that cannot be read fail here, not after the model is built."""
    check_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_repo)
    if cfg.data.source == "files":
        expand_data_paths(list(cfg.data.paths))
    for paths in named_sets(list(cfg.data.valid_paths)).values():
        expand_data_paths(paths, key="data.valid_paths")


def _check_folders(cfg: RunConfig) -> None:
    named = {"logging.output_dir": Path(cfg.logging.output_dir), "checkpoint.dir": checkpoint_root(cfg)}
    for key, path in named.items():
        if path.exists() and not path.is_dir():
            raise InputError(f"{key}={path} is a file, not a folder; set {key} to a folder path")


def previous_run(cfg: RunConfig) -> list[str]:
    """What marks the run folder (and checkpoint folder) as used by an earlier run, newest last."""
    out_dir, ckpt_root = Path(cfg.logging.output_dir), checkpoint_root(cfg)
    # A ``step_*.tmp`` is a save a killed run never finished: no run's state, and the next save
    # removes it; only finished checkpoints mark the folder as used.
    steps = ckpt_root.glob("step_*") if ckpt_root.is_dir() else []
    marks = sorted(str(p) for p in steps if not p.name.endswith(".tmp"))
    if (out_dir / METRICS_FILE).is_file():
        marks.append(str(out_dir / METRICS_FILE))
    return marks


def _check_unused(cfg: RunConfig) -> None:
    marks = previous_run(cfg)
    if marks:
        raise InputError(f"logging.output_dir={cfg.logging.output_dir} already holds a run ({len(marks)} "
                         f"checkpoint and metrics entries, e.g. {marks[-1]}); add --resume to continue it, "
                         f"--overwrite to move it aside, or set logging.output_dir to a new folder")


def move_previous_run_aside(cfg: RunConfig) -> list[tuple[Path, Path]]:
    """Rename the used run folder (and a separate checkpoint.dir) to ``<name>.old-<time>``.

    Returns (old, new) for each folder moved; nothing is deleted, so an old run stays readable.
    """
    if not previous_run(cfg):
        return []
    out_dir, ckpt_root = Path(cfg.logging.output_dir), checkpoint_root(cfg)
    folders = [out_dir]
    if ckpt_root.is_dir() and not ckpt_root.resolve().is_relative_to(out_dir.resolve()):
        folders.append(ckpt_root)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moves = []
    for folder in folders:
        if folder.is_dir():
            target = _free_name(folder, stamp)
            folder.rename(target)
            moves.append((folder, target))
    return moves


def _free_name(folder: Path, stamp: str) -> Path:
    # Two overwrites within a second must not collide.
    target, n = folder.with_name(f"{folder.name}.old-{stamp}"), 1
    while target.exists():
        target, n = folder.with_name(f"{folder.name}.old-{stamp}-{n}"), n + 1
    return target
