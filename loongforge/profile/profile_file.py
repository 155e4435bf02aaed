"""PROFILE.jsonl: one JSON object per line, three kinds (pure Python, no torch).

``env``          once, first line: device, dtype, layout, preset, model sizes, sweep or data.
``micro_batch``  one per rank per micro-batch: the samples (``L``, ``patches``), the aggregated
                 features in ``cost_model.TERMS`` order, and that rank's own ``forward_s`` and
                 ``backward_s`` (compute only: megatron's forward-compute / backward-compute
                 intervals, which exclude pipeline send/receive and the gradient all-reduce);
                 ``forward_cpu_s`` / ``backward_cpu_s``: the same intervals in process CPU time.
``step``         one per rank per step: ``step_s`` (the whole ``train_step``: forward, backward,
                 grad sync, optimizer), ``fwd_bwd_s`` (the schedule, grad sync included) and
                 ``grad_sync_s`` (time in megatron's finalize_model_grads: all-reduce plus waiting
                 for the slowest rank); ``*_cpu_s``: the same in process CPU time.

Every record carries ``step``, ``rank`` and ``warmup`` (true for the first steps, which pay for
allocation and are left out of fits by default).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from loongforge.balance.cost_model import TERMS
from loongforge.config.errors import InputError

PROFILE_FORMAT = "loongforge-profile/1"
TIME_KEYS = ("forward_s", "backward_s", "forward_cpu_s", "backward_cpu_s")


@dataclass
class Profile:
    """The records of one or more PROFILE.jsonl files that describe the same setup."""

    env: dict
    micro_batches: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


def write_records(path: str | Path, records: Iterable[dict], *, append: bool = True) -> None:
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def _check_times(record: dict, where: str) -> None:
    for key in TIME_KEYS:
        if key not in record and key.endswith("_cpu_s"):
            continue  # optional
        value = record.get(key)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InputError(f"{where}: {key}={value!r} is not a finite non-negative time; the "
                             f"profile is corrupt or was edited, profile again with "
                             f"`loongforge profile`")
    features = record.get("features")
    if not isinstance(features, dict) or any(t not in features for t in TERMS if t != "n_loss"):
        raise InputError(f"{where}: micro_batch record lacks features {list(TERMS)}; "
                         f"write profiles with `loongforge profile`")


# Environment keys that must agree between files fitted together: a cost model describes one
# model on one kind of device at one precision.
_MUST_MATCH = ("format", "device", "dtype", "preset", "model")


def read_profile(paths: Iterable[str | Path]) -> Profile:
    """Read and check PROFILE.jsonl files; InputError names the file and line of a bad record."""
    profile: Profile | None = None
    for path in map(Path, paths):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise InputError(f"{path}: cannot read profile ({exc.strerror}); pass a PROFILE.jsonl "
                             f"written by `loongforge profile`") from exc
        env, mbs, steps = None, [], []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not JSON ({exc.msg})") from exc
            kind = record.get("kind")
            if kind == "env":
                env = record
            elif kind == "micro_batch":
                _check_times(record, where)
                mbs.append(record)
            elif kind == "step":
                steps.append(record)
            else:
                raise InputError(f"{where}: unknown record kind {kind!r}")
        if env is None or env.get("format") != PROFILE_FORMAT:
            raise InputError(f"{path}: no {PROFILE_FORMAT} env record; write profiles with "
                             f"`loongforge profile`")
        if not mbs:
            raise InputError(f"{path}: the profile has no micro_batch records (empty run?); "
                             f"profile some steps with `loongforge profile --steps N`")
        if profile is None:
            profile = Profile(env=env)
        else:
            diff = [k for k in _MUST_MATCH if profile.env.get(k) != env.get(k)]
            if diff:
                raise InputError(f"{path}: its {', '.join(diff)} differ from {profile.sources[0]}'s; "
                                 f"fit one cost model per model, device and precision")
        # Steps of different files are different observations: key them apart.
        offset = len(profile.sources) * 1_000_000
        for record in mbs + steps:
            record["step_key"] = offset + int(record["step"])
        profile.micro_batches += mbs
        profile.steps += steps
        profile.sources.append(str(path))
    if profile is None:
        raise InputError("no profile given; pass one or more PROFILE.jsonl files")
    return profile
