"""From preset name, config file and overrides to a validated RunConfig, and back to YAML.

Layers, later ones winning:

1. the schema defaults (``loongforge.config.schema``);
2. the preset, composed from its component files (``loongforge.config.presets``);
3. the user's ``--config FILE.yaml`` (it may list ``components`` too);
4. ``key=value`` / ``~key`` overrides, left to right (``loongforge.config.overrides``).

``~key`` removes the key from the composed tree, so layer 1 applies to it again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from loongforge.config.errors import ConfigError
from loongforge.config.interpolation import resolve_interpolations
from loongforge.config.overrides import Override, apply_overrides, parse_override
from loongforge.config.presets import DEFAULT_PRESET, compose_file, compose_preset, deep_merge
from loongforge.config.schema import RunConfig
from loongforge.config.validate import KeyLocator, is_schema_path, unknown_key_message, validate_tree
from loongforge.config.yaml_io import dump_yaml_tree, key_lines


def _parse_overrides(overrides: Sequence[str | Override]) -> list[Override]:
    """Parse all overrides, reporting every malformed one and every unknown ``~key`` at once.

    Already-built ``Override`` objects (from dedicated flags such as --output-dir) pass through.
    """
    parsed, errors = [], []
    for item in overrides:
        try:
            override = item if isinstance(item, Override) else parse_override(item)
        except ConfigError as exc:
            errors.extend(exc.messages)
            continue
        text = override.text
        # A deleted key absent from the tree is a silent no-op, so typos are caught here instead;
        # trailing list indexes (data.paths.0) are not schema keys.
        schema_part = ".".join(s for s in override.path if not s.isdigit())
        if override.delete and not is_schema_path(schema_part):
            errors.append(f"override '{text}': {unknown_key_message(schema_part)}")
        parsed.append(override)
    if errors:
        raise ConfigError(errors)
    return parsed


def compose_tree(preset: str | None = DEFAULT_PRESET, *, config_file: Path | None = None,
                 overrides: Sequence[str | Override] = ()) -> dict[str, Any]:
    """The merged (not yet validated) tree of preset, config file and overrides."""
    tree = compose_preset(preset) if preset else {}
    if config_file is not None:
        tree = deep_merge(tree, compose_file(Path(config_file)))
    return apply_overrides(tree, _parse_overrides(overrides))


def load_run_config(preset: str | None = DEFAULT_PRESET, *, config_file: Path | None = None,
                    overrides: Sequence[str | Override] = (),
                    world_size: int | None = None) -> RunConfig:
    """Compose, validate and return the run config; raises ConfigError listing every problem.

    ``world_size`` is the launch's process count; it replaces ``parallel.world_size`` so the
    resolved config records the layout that actually ran. Without it the config's value is used.
    """
    tree = compose_tree(preset, config_file=config_file, overrides=overrides)
    if world_size is not None:
        tree = deep_merge(tree, {"parallel": {"world_size": world_size}})
    locate = _config_file_locator(config_file, overrides)
    tree = resolve_interpolations(tree, locate=locate)
    return validate_tree(tree, world_size, locate=locate)


def _config_file_locator(config_file: Path | None, overrides: Sequence[str | Override]) -> KeyLocator:
    """``file:line`` for keys the user's config file sets last (an override wins over the file)."""
    def locate(dotted: str) -> str | None:
        # Called only for a broken key, so the file is read again only when there is an error.
        lines = key_lines(Path(config_file)) if config_file is not None else {}
        overridden = [".".join(o.path) for o in _parse_overrides(overrides)]
        if dotted not in lines or any(dotted == o or dotted.startswith(f"{o}.") for o in overridden):
            return None
        return f"{config_file}:{lines[dotted]}"
    return locate


def set_keys(overrides: Sequence[str], config_file: Path | None = None) -> list[str]:
    """The dotted keys the user set, not the preset: each ``key=value`` (or ``~key``) override's and
    each leaf key of ``config_file``."""
    file_keys = list(key_lines(Path(config_file))) if config_file is not None else []
    leaves = [key for key in file_keys if not any(other.startswith(f"{key}.") for other in file_keys)]
    return [parse_override(text).dotted for text in overrides] + leaves


def load_resolved_config(path: Path, world_size: int | None = None) -> RunConfig:
    """Read back a config written by ``dump_yaml`` (e.g. a run folder's ``config.yaml``)."""
    return load_run_config(None, config_file=path, world_size=world_size)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dicts/lists of every field, schema order."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: RunConfig) -> str:
    """The full resolved config as YAML; ``load_resolved_config`` reads it back unchanged."""
    return dump_yaml_tree(to_dict(cfg))
