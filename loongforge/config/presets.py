"""Finding presets and composing them from component files.

A preset is a ``loongforge/presets/<name>.yaml`` (package data, so an installed wheel has them). Any config file (preset, component or a user's
``--config``) may start with two meta keys that are not part of the run config:

* ``components``: files it builds on, as paths relative to the presets folder, merged in order;
  a component may list components itself;
* ``description``: one line shown by ``loongforge train --show-preset``.

The file's own keys are merged on top of its components: mappings merge key by key, anything else
(numbers, strings, lists) replaces. The composition format is also documented at the top of
``loongforge/presets/qwen2.5vl-7b.yaml``.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

from loongforge.config.errors import ConfigError
from loongforge.config.yaml_io import read_yaml_mapping

PRESETS_ENV_VAR = "LOONGFORGE_PRESETS"
# The preset `loongforge train` uses without --preset: small enough to train on two CPU cores.
DEFAULT_PRESET = "qwen2.5vl-tiny"
COMPONENTS_KEY = "components"
DESCRIPTION_KEY = "description"
_META_KEYS = (COMPONENTS_KEY, DESCRIPTION_KEY)


def presets_dir() -> Path:
    """The presets folder: $LOONGFORGE_PRESETS, else the ``presets/`` shipped inside the package."""
    override = os.environ.get(PRESETS_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path(__file__).resolve().parents[1] / "presets"


def _natural_key(name: str) -> list[Any]:
    # qwen2.5vl-3b before qwen2.5vl-32b: digit runs compare as numbers.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def list_preset_names(root: Path | None = None) -> list[str]:
    root = root or presets_dir()
    return sorted((path.stem for path in root.glob("*.yaml")), key=_natural_key)


def preset_path(name: str, root: Path | None = None) -> Path:
    root = root or presets_dir()
    path = root / f"{name}.yaml"
    if path.is_file():
        return path
    names = list_preset_names(root)
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f" did you mean '{close[0]}'?" if close else ""
    available = ", ".join(names) if names else f"none found in {root}"
    raise ConfigError(f"unknown preset '{name}';{hint} available presets: {available} "
                      f"(see `loongforge train --list-presets`).")


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """A new tree: ``overlay`` on top of ``base``; mappings merge, everything else replaces."""
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _component_path(entry: Any, including_file: Path, root: Path) -> Path:
    if not isinstance(entry, str):
        raise ConfigError(f"{including_file}: '{COMPONENTS_KEY}' entries must be paths relative "
                          f"to {root}, got {entry!r}.")
    path = root / (entry if entry.endswith(".yaml") else f"{entry}.yaml")
    if not path.is_file():
        raise ConfigError(f"{including_file}: component '{entry}' not found (looked for {path}); "
                          f"component paths are relative to the presets folder {root}.")
    return path


def compose_file(path: Path, root: Path | None = None,
                 _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The config tree of ``path`` with its components merged underneath, meta keys removed."""
    root = root or presets_dir()
    if path.resolve() in _chain:
        cycle = " -> ".join(str(p.name) for p in (*_chain, path.resolve()))
        raise ConfigError(f"components include each other in a cycle: {cycle}; remove one link.")
    own = read_yaml_mapping(path)
    entries = own.get(COMPONENTS_KEY) or []
    if not isinstance(entries, list):
        entries = [entries]
    tree: dict[str, Any] = {}
    for entry in entries:
        component = _component_path(entry, path, root)
        tree = deep_merge(tree, compose_file(component, root, (*_chain, path.resolve())))
    own_keys = {key: value for key, value in own.items() if key not in _META_KEYS}
    return deep_merge(tree, own_keys)


def compose_preset(name: str, root: Path | None = None) -> dict[str, Any]:
    """The composed tree of preset ``name`` (``preset: name`` included)."""
    tree = compose_file(preset_path(name, root), root)
    tree["preset"] = name
    return tree


def preset_description(name: str, root: Path | None = None) -> str | None:
    description = read_yaml_mapping(preset_path(name, root)).get(DESCRIPTION_KEY)
    return str(description) if description is not None else None
