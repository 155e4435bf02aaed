"""The settings that decide which sample each saved data position points at.

A checkpoint's data position is an (epoch, cursor) into the permutation that ``data.seed`` and
``data.shuffle`` draw (and into the training samples left after ``data.valid_fraction`` holds its
share out). Resumed with another of these, the same position names other samples: on 120 records a
new seed trained 31 samples twice and 31 never in the epoch, and a redrawn held-out set held samples
already trained on. So checkpoints record them, as they record the mixture weights, and a resume
with other values stops, unless ``data.accept_new_order=true`` asks for the data to start afresh.
"""

from __future__ import annotations

from typing import Optional

from loongforge.config.errors import InputError
from loongforge.config.schema import DataConfig


def data_order(data_cfg: DataConfig) -> dict:
    """The order-deciding settings by their config keys (what a checkpoint records)."""
    return {"data.seed": data_cfg.seed, "data.shuffle": data_cfg.shuffle,
            "data.valid_fraction": data_cfg.valid_fraction}


def changed_keys(saved: Optional[dict], current: dict) -> list[str]:
    """The order-deciding keys whose value differs from the checkpoint's; none for a checkpoint that
    recorded no order (saved before the order was recorded: nothing to compare with)."""
    if saved is None:
        return []
    return [key for key in current if key in saved and saved[key] != current[key]]


def check_order(saved: Optional[dict], current: dict, *, checkpoint: str, accept_new: bool) -> Optional[str]:
    """None when the checkpoint's data order is this run's; with ``accept_new`` the note to log
    when it is not (the data then starts afresh); an InputError otherwise, naming the first
    changed key, both values and the two ways on."""
    keys = changed_keys(saved, current)
    if not keys:
        return None
    if accept_new:
        changes = ", ".join(f"{key} {saved[key]} -> {current[key]}" for key in keys)
        return (f"data.accept_new_order=true: the data order changed since {checkpoint} ({changes}); "
                "the data starts afresh at epoch 0 in this run's order (the model, optimizer and schedule "
                "continue)")
    key = keys[0]
    # data.valid_fraction's held-out set is drawn by data.seed: it changes with either
    redrawn = key != "data.shuffle" and (saved.get("data.valid_fraction") or current["data.valid_fraction"])
    held_out = ", and validate on a held-out set drawn anew" if redrawn else ""
    raise InputError(f"{checkpoint} was trained with {key}={saved[key]} and this run has {key}={current[key]}: its "
                     f"data position indexes the old order, so resuming in the new one would train some samples "
                     f"twice and others never{held_out}; set {key}={saved[key]} to resume, or "
                     f"data.accept_new_order=true to start the data afresh at epoch 0 in the new order")
