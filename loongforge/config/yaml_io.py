"""YAML reading and writing with the two PyYAML surprises fixed.

* PyYAML follows YAML 1.1, where ``1e-5`` (no dot) is a *string*; learning rates are written that
  way, so the loader resolves any decimal/exponent literal as a float.
* PyYAML silently keeps the last of two equal keys; a duplicated key in a config is almost always
  a mistake, so it is reported with its line and column.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from loongforge.config.errors import ConfigError

_FLOAT_PATTERN = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-5`` as a float, only true/false as booleans (YAML 1.2: ``on``,
    ``off``, ``yes``, ``no`` stay words, e.g. ``training.fp8: on``) and rejects duplicate keys."""

    def construct_mapping(self, node, deep=False):  # noqa: D401 - PyYAML hook
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# Replace the YAML 1.1 float resolver (which needs a dot) with one that also takes `1e-5`.
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_PATTERN,
                                    list("-+0123456789."))
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _ConfigLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))


class _ConfigDumper(yaml.SafeDumper):
    """Writes short lists of scalars inline (``[16, 24, 24]``), everything else block style."""

    def represent_list(self, data):
        inline = all(isinstance(item, (int, float, str, bool)) or item is None for item in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=inline)


_ConfigDumper.add_representer(list, _ConfigDumper.represent_list)


def _syntax_error(source: str, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    return ConfigError(f"{where}: YAML syntax error: {problem}; fix the file at that position.")


def parse_yaml_text(text: str, source: str) -> Any:
    """Parse YAML text; ``source`` names it (a path) in syntax errors as ``source:line:col``."""
    try:
        return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise _syntax_error(source, exc) from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        message = f"cannot read config file {path}: {exc.strerror}; check the path."
        raise ConfigError(message) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}); save the config file as UTF-8.") from None


def key_lines(path: Path) -> dict[str, int]:
    """Dotted key -> the 1-based line where the YAML file ``path`` sets it (for error messages)."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            dotted = f"{prefix}{key_node.value}"
            lines[dotted] = key_node.start_mark.line + 1
            walk(value_node, f"{dotted}.")

    walk(yaml.compose(_read_text(path), Loader=_ConfigLoader), "")
    return lines


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML file whose top level must be a mapping (an empty file is an empty mapping)."""
    tree = parse_yaml_text(_read_text(path), str(path))
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys (section: ...), "
                          f"not a {type(tree).__name__}.")
    return tree


def parse_override_value(text: str) -> Any:
    """Parse the value side of ``key=value`` as a YAML scalar or flow list (``[1, 2]``).

    A value that does not parse as YAML (``[1, 2``, ``a: [``) is kept as the literal string, which
    is what a user typing a path or prompt on the command line means; quote values containing
    ``: `` to keep them strings.
    """
    try:
        return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return text


def dump_yaml_tree(tree: dict[str, Any]) -> str:
    return yaml.dump(tree, Dumper=_ConfigDumper, sort_keys=False, allow_unicode=True, width=100)
