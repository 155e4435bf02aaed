"""How ``data.valid_paths`` names its validation sets: entries ``name=path`` or a bare path (the set
is then named after the file); entries that share a name form one set, read in the order given.
``data.valid_fraction``'s held-out set is named ``HELD_OUT_SET``."""

from __future__ import annotations

import re
from pathlib import Path

HELD_OUT_SET = "heldout"
_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def named_sets(valid_paths: list[str]) -> dict[str, list[str]]:
    """{set name: its paths}, in the order the sets are first named."""
    sets: dict[str, list[str]] = {}
    for entry in valid_paths:
        name, sep, path = entry.partition("=")
        if not (sep and _SET_NAME.fullmatch(name)):  # a bare path (which may itself hold "=")
            name, path = Path(entry.rstrip("/")).stem or entry, entry
        sets.setdefault(name, []).append(path)
    return sets
