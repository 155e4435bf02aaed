"""The features and the shared layers below them name no model family or vision tower in code.

A family is named only in its folder (``loongforge/models/<family>/``), a tower in its own
(``models/towers/<arch>/``), the Qwen families' shared pieces live in ``models/qwen_vl/``, and
presets, tests and docs name them freely. Everything outside ``models/`` and ``presets/`` (``config/``,
``data/``, ``train/``, ``convert/``, ``encode/``, ``profile/``, ``bench/``, ``pack/``, ``calibrate/``,
``balance/``, ``parallel/``, ``cli/``) reaches a model through ``models.registry`` (``model.family``) and
``models.parts`` (``model.vision.arch``), so adding a family touches no feature. A preset's name
(``llm-tiny``, ``qwen2.5vl-tiny``) is not a family's and may be named anywhere.

Checked on the code's tokens (names and string literals, f-strings included); comments and
docstrings may name a model as an example.
"""

from __future__ import annotations

import ast
import io
import re
import time
import tokenize
from pathlib import Path

import loongforge
from loongforge.models import parts, registry

PACKAGE_ROOT = Path(loongforge.__file__).parent
# Where a model may be named: its own folder and the models package around it, and the presets.
MODEL_PACKAGES = ("models", "presets")
# The Qwen-VL families' shared folder: smart-resize, processor files, ChatML, video sampling.
SHARED_FAMILY_FOLDERS = ("qwen_vl",)
# transformers' class-name endings of a model's classes beside its ``...For...`` architecture names
_HF_CLASS_SUFFIX = re.compile(r"(For[A-Za-z]+|Model)$")


def forbidden_names() -> dict[str, str]:
    """word -> what it names: the registered families, the towers, the shared family folders, and the
    transformers classes the families read (their ``hf_architectures``, each one's ``...Config``)."""
    names = {name: "family" for name in registry.families()}
    names.update({arch: "tower" for arch in parts.towers()})
    names.update({folder: "family folder" for folder in SHARED_FAMILY_FOLDERS})
    for family_name in registry.families():
        family = registry.get_family(family_name)
        for architecture in family.hf_architectures:
            names[architecture] = f"transformers class of {family_name}"
            names[_HF_CLASS_SUFFIX.sub("", architecture) + "Config"] = f"transformers config of {family_name}"
    return names


def _docstring_lines(tree: ast.AST) -> set[int]:
    """Lines of bare string statements (docstrings and string comments)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def _model_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of each import of a family folder, a tower folder or a shared family folder."""
    folders = [*registry.families(), *SHARED_FAMILY_FOLDERS, "towers"]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        model_modules = [module for module in modules
                         if any(module == f"loongforge.models.{folder}" or module.startswith(f"loongforge.models.{folder}.")
                                for folder in folders)]
        if model_modules:
            found.append((node.lineno, model_modules[0]))
    return found


def _word_pattern(names: dict[str, str], boundary: str = "A-Za-z0-9_-") -> re.Pattern:
    """A name as a word of a string: not inside a longer identifier, nor a hyphenated preset name
    (``llm-tiny`` is a preset, which may be named anywhere)."""
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    return re.compile(f"(?<![{boundary}])(" + alternatives + f")(?![{boundary}])")


def name_hits(text: str, names: dict[str, str], words: re.Pattern | None = None) -> dict[int, list[str]]:
    """line -> what it names, for each family/tower/class name in ``text``'s code: a name token equal
    to one, a string literal holding one as a word, an import of a model folder. Comments and
    docstrings are skipped."""
    tree = ast.parse(text)
    skipped = _docstring_lines(tree)
    words = words or _word_pattern(names)
    hits = [(line, f"imports {module}") for line, module in _model_imports(tree)]
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.NAME and token.string in names:
            hits.append((token.start[0], f"{names[token.string]} {token.string}"))
        elif token.type == tokenize.STRING and token.start[0] not in skipped:
            hits += [(token.start[0], f"{names[word]} {word}") for word in words.findall(token.string)]
    by_line: dict[int, list[str]] = {}
    for line, what in hits:
        by_line.setdefault(line, [])
        if what not in by_line[line]:
            by_line[line].append(what)
    return dict(sorted(by_line.items()))


def model_name_hits(root: Path = PACKAGE_ROOT) -> list[str]:
    """``file:line: what: the line`` for every line naming a model outside ``MODEL_PACKAGES`` under ``root``."""
    names = forbidden_names()
    words = _word_pattern(names)
    anywhere = _word_pattern({**names, "towers": "folder"}, boundary="A-Za-z0-9_")
    report = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in MODEL_PACKAGES:
            continue
        text = path.read_text()
        if not anywhere.search(text):  # most files hold no such word at all: skipped unparsed
            continue
        lines = text.splitlines()
        for line, what in name_hits(text, names, words).items():
            report.append(f"{path.relative_to(root)}:{line}: {', '.join(what)}: {lines[line - 1].strip()}")
    return report


def test_features_name_no_family_or_tower():
    start = time.perf_counter()
    hits = model_name_hits()
    print(f"{len(hits)} lines naming a family or tower outside {' and '.join(MODEL_PACKAGES)} "
          f"({time.perf_counter() - start:.2f} s)")
    assert not hits, ("a family or tower named outside its folder (reach it through models.registry / "
                      "models.parts, or move the knowledge into the family's folder):\n" + "\n".join(hits))


def test_the_check_sees_names_in_code_not_in_comments():
    names = {"qwen2_5_vl": "family", "qwen2_5_vit": "tower", "llm": "family", "qwen_vl": "family folder",
             "Qwen2_5_VLConfig": "transformers config of qwen2_5_vl"}
    text = ('"""Reads qwen2_5_vl (a docstring may name it)."""\n'
            "from loongforge.models.qwen_vl import smart_resize\n"
            "from transformers import Qwen2_5_VLConfig  # comment: qwen2_5_vl\n"
            "def f(x):\n"
            '    """qwen2_5_vit in a docstring."""\n'
            "    # qwen2_5_vl in a comment\n"
            "    return x == 'qwen2_5_vl' or f'models/towers/qwen2_5_vit/flops.py {x}' or 'qwen2_5_vlx' or 'llm-tiny'\n")
    assert name_hits(text, names) == {
        2: ["imports loongforge.models.qwen_vl", "family folder qwen_vl"],
        3: ["transformers config of qwen2_5_vl Qwen2_5_VLConfig"],
        7: ["family qwen2_5_vl", "tower qwen2_5_vit"]}
