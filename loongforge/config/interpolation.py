"""``${...}`` references between config values, resolved by OmegaConf on the composed tree.

``logging.output_dir: runs/${preset}`` or ``checkpoint.dir: ${logging.output_dir}/ckpt``: a value may
name any other key of the composed config (preset, components, config file and ``key=value``
overrides all merged), or any schema key at its default (the schema as an OmegaConf structured
config), by its dotted path; a value that is only a reference takes the referenced
value's type (``training.seed: ${data.shuffle_seed}`` stays an integer). References resolve before
validation, so the resolved config (the run folder's ``config.yaml``) holds the values the run used.
A literal ``${`` is written ``\\${``. Every unresolvable reference is reported at once, one line
each, naming the key (and its file and line when a config file set it) and, for a misspelt target,
the key it probably meant.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Optional

from omegaconf import Container, OmegaConf
from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException

from loongforge.config.errors import ConfigError
from loongforge.config.presets import deep_merge
from loongforge.config.schema import RunConfig
from loongforge.config.validate import KeyLocator, unknown_key_message


def _references(tree: Any, path: str = "") -> Iterator[str]:
    """Dotted paths of the string values (in mappings and lists) that hold a ``${``."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _references(value, f"{path}.{key}" if path else str(key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _references(value, f"{path}.{index}")
    elif isinstance(tree, str) and "${" in tree:
        yield path


def _problem(path: str, value: str, exc: OmegaConfBaseException, locate: Optional[KeyLocator]) -> str:
    where = locate(path) if locate else None
    prefix = f"{where}: " if where else ""
    reason = str(exc).splitlines()[0]
    if isinstance(exc, InterpolationKeyError):
        target = reason.split("'")[1] if "'" in reason else reason
        return f"{prefix}{path}={value!r}: the reference names no key of the config ({unknown_key_message(target)})"
    return f"{prefix}{path}={value!r}: cannot resolve the reference ({reason}); write a literal ${{ as \\${{"


def schema_defaults() -> dict[str, Any]:
    """Every key of the schema with its default, from the schema as an OmegaConf structured config."""
    return OmegaConf.to_container(OmegaConf.structured(RunConfig))


def resolve_interpolations(tree: dict[str, Any], *, locate: Optional[KeyLocator] = None) -> dict[str, Any]:
    """``tree`` with every ``${...}`` reference replaced by what it names (a key the tree sets, or
    any other schema key at its default); a ConfigError listing every reference that does not
    resolve. A tree without references is returned as it is."""
    paths = list(_references(tree))
    if not paths:
        return tree
    config = OmegaConf.create(deep_merge(schema_defaults(), tree))
    resolved, errors = copy.deepcopy(tree), []
    for path in paths:
        try:
            value = OmegaConf.select(config, path, throw_on_resolution_failure=True)
        except OmegaConfBaseException as exc:
            errors.append(_problem(path, _raw(tree, path), exc, locate))
            continue
        if isinstance(value, Container):
            value = OmegaConf.to_container(value, resolve=True)
        _set(resolved, path, value)
    if errors:
        raise ConfigError(errors)
    return resolved


def _set(tree: Any, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    if isinstance(tree, list):
        tree[int(last)] = value
    else:
        tree[last] = value


def _raw(tree: Any, path: str) -> Any:
    for part in path.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree
