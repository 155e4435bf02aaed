"""Command-line overrides: ``dotted.key=value`` sets, ``~dotted.key`` deletes.

Values are YAML (``lr=3e-4``, ``mrope_section=[8,12,12]``, ``packed=null``). A path segment that is
a number indexes into a list (``data.paths.0=/data/a.jsonl``). Deleting a key removes it from the
composed tree, so the schema default applies again, whatever the preset or config file said.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Sequence

from loongforge.config.errors import ConfigError
from loongforge.config.yaml_io import parse_override_value

_SEGMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$|^[0-9]+$")


@dataclass(frozen=True)
class Override:
    text: str
    path: tuple[str, ...]
    delete: bool
    value: Any = None

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


def _parse_path(text: str, dotted: str) -> tuple[str, ...]:
    segments = tuple(dotted.strip().split("."))
    if not all(_SEGMENT.match(segment) for segment in segments):
        raise ConfigError(f"override '{text}': '{dotted}' is not a dotted key like "
                          f"optimizer.lr; write key=value or ~key.")
    return segments


def parse_override(text: str) -> Override:
    if text.startswith("~"):
        if "=" in text:
            raise ConfigError(f"override '{text}': ~key deletes a key and takes no value; "
                              f"write ~{text[1:].split('=', 1)[0]}.")
        return Override(text, _parse_path(text, text[1:]), delete=True)
    if "=" not in text:
        raise ConfigError(f"argument '{text}' is not a key=value override; write e.g. "
                          f"optimizer.lr=1e-4, or ~optimizer.lr to restore the default.")
    dotted, raw_value = text.split("=", 1)
    return Override(text, _parse_path(text, dotted), delete=False,
                    value=parse_override_value(raw_value))


def _child(container: Any, segment: str) -> Any:
    if isinstance(container, list) and segment.isdigit():
        index = int(segment)
        return container[index] if index < len(container) else None
    if isinstance(container, dict):
        return container.get(segment)
    return None


def _walk_to_parent(tree: dict[str, Any], override: Override, create: bool) -> Any:
    """The container holding the last path segment; None when it does not exist (delete)."""
    node: Any = tree
    for depth, segment in enumerate(override.path[:-1]):
        child = _child(node, segment)
        if child is None and create and isinstance(node, dict):
            child = node[segment] = {}
        if child is None:
            return None
        if not isinstance(child, (dict, list)):
            prefix = ".".join(override.path[: depth + 1])
            raise ConfigError(f"override '{override.text}': '{prefix}' holds the value "
                              f"{child!r}, not a section, so it has no key "
                              f"'{override.path[depth + 1]}'.")
        node = child
    return node


def _set(tree: dict[str, Any], override: Override) -> None:
    parent = _walk_to_parent(tree, override, create=True)
    last = override.path[-1]
    if isinstance(parent, list):
        if not last.isdigit() or int(last) >= len(parent):
            raise ConfigError(f"override '{override.text}': index {last} is outside the list of "
                              f"{len(parent)} items; set the whole list instead "
                              f"({override.dotted.rsplit('.', 1)[0]}=[...]).")
        parent[int(last)] = override.value
    else:
        parent[last] = override.value


def _delete(tree: dict[str, Any], override: Override) -> None:
    parent = _walk_to_parent(tree, override, create=False)
    last = override.path[-1]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        parent.pop(int(last))
    elif isinstance(parent, dict):
        parent.pop(last, None)


def apply_overrides(tree: dict[str, Any], overrides: Sequence[str | Override]) -> dict[str, Any]:
    """A new tree with ``overrides`` applied left to right; every malformed one is reported."""
    result = copy.deepcopy(tree)
    errors: list[str] = []
    for item in overrides:
        try:
            override = item if isinstance(item, Override) else parse_override(item)
            (_delete if override.delete else _set)(result, override)
        except ConfigError as exc:
            errors.extend(exc.messages)
    if errors:
        raise ConfigError(errors)
    return result
