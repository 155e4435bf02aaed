"""The house rules of the package layout, checked on every import statement (function-local ones
included): no import cycle between subpackages, project imports at module top outside ``cli/``, and
a why-comment on every third-party import made inside a function (a lazy import is a choice about
what a process pays at start; the comment keeps the reason, e.g. ``# lazy: only plotting needs it``).

The layers, top to bottom: cli -> features (bench, calibrate, train, pack, convert, encode) -> data ->
profile -> balance / models -> parallel -> config. A new arrow that points back up shows as a
cycle here, with the modules that make it.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

import loongforge
from loongforge.models import registry

PACKAGE_ROOT = Path(loongforge.__file__).parent
LAZY_IMPORTS_ALLOWED = {"cli"}  # kept lazy so `loongforge --help` imports no torch


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level == 0:
            return [node.module or ""]
        base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        return [".".join(base + ([node.module] if node.module else []))]
    return []


def _inside_functions(tree: ast.AST) -> set[int]:
    """ids of the nodes that sit inside a function body."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(child) for child in ast.walk(node) if child is not node)
    return inside


def _project_imports():
    """(subpackage, file, imported module, inside a function) for every loongforge import."""
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        relative = path.relative_to(PACKAGE_ROOT)
        subpackage = relative.parts[0] if len(relative.parts) > 1 else None
        module = _module_name(path)
        tree = ast.parse(path.read_text())
        in_function = _inside_functions(tree)
        for node in ast.walk(tree):
            for name in _imported_modules(node, module, path.name == "__init__.py"):
                if name.startswith("loongforge."):
                    yield subpackage, str(relative), name, id(node) in in_function


def _commented_lines(text: str) -> set[int]:
    """Lines that carry a comment, and lines right below a comment-only line."""
    lines = text.splitlines()
    commented = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            commented.add(token.start[0])
            if lines[token.start[0] - 1].lstrip().startswith("#"):
                commented.add(token.start[0] + 1)
    return commented


def _lazy_third_party_imports():
    """(file:line, imported module, has a why-comment) for every import of a module that is neither
    the standard library's nor loongforge's, inside a function outside ``cli/``. A comment on any line
    of the import, or right above it, counts; so does one over a run of consecutive local imports."""
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        relative = path.relative_to(PACKAGE_ROOT)
        if len(relative.parts) > 1 and relative.parts[0] in LAZY_IMPORTS_ALLOWED:
            continue
        text = path.read_text()
        tree = ast.parse(text)
        in_function, commented = _inside_functions(tree), _commented_lines(text)
        local = sorted((node for node in ast.walk(tree) if id(node) in in_function
                        and isinstance(node, (ast.Import, ast.ImportFrom))), key=lambda node: node.lineno)
        covered = set()  # local imports under a comment, directly or through the run above them
        for node in local:
            lines = set(range(node.lineno, node.end_lineno + 1))
            if lines & commented or node.lineno - 1 in covered:
                covered.update(lines)
        for node in local:
            name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            top = (name or "").split(".")[0]
            if getattr(node, "level", 0) or top in sys.stdlib_module_names or top in ("loongforge", "__future__"):
                continue
            yield f"{relative}:{node.lineno}", name, node.lineno in covered


def _subpackage_graph() -> dict[str, dict[str, list[str]]]:
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for subpackage, file, name, _ in _project_imports():
        target = name.split(".")[1]
        if subpackage and target != subpackage and (PACKAGE_ROOT / target).is_dir():
            graph[subpackage][target].append(f"{file} -> {name}")
    return graph


def _find_cycle(graph) -> list[str]:
    """One cycle as a list of subpackages (first == last), or [] when the graph is acyclic."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_cycle_between_subpackages():
    graph = _subpackage_graph()
    cycle = _find_cycle(graph)
    arrows = [f"{a} -> {b}: {graph[a][b][0]}" for a, b in zip(cycle, cycle[1:])]
    assert not cycle, "import cycle between subpackages:\n" + "\n".join(arrows)


def _module_graph() -> dict[str, dict[str, list[str]]]:
    """Module -> modules it imports (any import: module top, function, ``TYPE_CHECKING``; a
    ``from package import module`` counts the module)."""
    modules = {_module_name(path): path for path in PACKAGE_ROOT.rglob("*.py")}
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _imported_modules(node, module, path.name == "__init__.py"):
                targets = [name] + [f"{name}.{alias.name}" for alias in getattr(node, "names", [])
                                    if isinstance(node, ast.ImportFrom)]
                for target in targets:
                    if target in modules and target != module:
                        graph[module][target].append(f"{path.relative_to(PACKAGE_ROOT)}:{node.lineno}")
    return graph


def test_no_import_cycle_between_modules():
    """Type-checking imports included: a circle of modules is one module in two files."""
    graph = _module_graph()
    cycle = _find_cycle(graph)
    arrows = [f"{a} -> {b}: {graph[a][b][0]}" for a, b in zip(cycle, cycle[1:])]
    assert not cycle, "import cycle between modules:\n" + "\n".join(arrows)


def test_project_imports_are_at_module_top_outside_cli():
    local = [f"{file}: {name}" for subpackage, file, name, inside in _project_imports()
             if inside and subpackage not in LAZY_IMPORTS_ALLOWED]
    assert not local, "project imports inside functions (move them to the module top):\n" + "\n".join(local)


def test_third_party_imports_inside_functions_say_why():
    bare = [f"{where}: {name}" for where, name, commented in _lazy_third_party_imports() if not commented]
    assert not bare, ("third-party imports inside functions without a comment saying why (same line or "
                      "the line above, e.g. '# lazy: only plotting needs matplotlib'):\n" + "\n".join(bare))


def test_the_checks_see_a_cycle_and_a_local_import(tmp_path, monkeypatch):
    """The checks themselves: a planted back-arrow and a function-local import are reported."""
    package = tmp_path / "loongforge"
    for name, text in {"__init__.py": "", "low/__init__.py": "", "high/__init__.py": "",
                       "low/a.py": "def f():\n    from loongforge.high.b import g\n",
                       "high/b.py": "from loongforge.low.a import f\n"}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE_ROOT"]), "PACKAGE_ROOT", package)
    assert _find_cycle(_subpackage_graph()) in (["high", "low", "high"], ["low", "high", "low"])
    assert [(f, n) for _, f, n, inside in _project_imports() if inside] == [("low/a.py", "loongforge.high.b")]


def test_the_check_sees_a_lazy_import_without_a_why(tmp_path, monkeypatch):
    """Bare and commented function-local imports of third-party, standard-library and cli modules."""
    package = tmp_path / "loongforge"
    (package / "cli").mkdir(parents=True)
    (package / "cli" / "__init__.py").write_text("def f():\n    import torch\n")
    (package / "a.py").write_text(
        "def bare():\n    import json\n    import numpy\n"
        "def above():\n    # lazy: only plotting needs it\n    import matplotlib\n    import matplotlib.pyplot\n"
        "def same_line():\n    from scipy import optimize  # lazy: only a fit needs scipy\n"
        "def after_code():\n    x = 1  # a comment about x\n    import torch\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE_ROOT"]), "PACKAGE_ROOT", package)
    assert list(_lazy_third_party_imports()) == [
        ("a.py:3", "numpy", False), ("a.py:6", "matplotlib", True), ("a.py:7", "matplotlib.pyplot", True),
        ("a.py:9", "scipy", True), ("a.py:12", "torch", False)]


def test_models_outside_the_family_folders_name_no_family():
    """The rest of the code reaches a model family through ``models.registry`` only (the shared
    packages of ``models``, its parts and the composition among them, are not families)."""
    families = registry.families()
    assert all((PACKAGE_ROOT / "models" / family / "__init__.py").exists() for family in families)
    direct = [f"{file}: {name}" for _, file, name, _ in _project_imports()
              if any(name.startswith(f"loongforge.models.{family}") for family in families)
              and not any(file.startswith(f"models/{family}/") for family in families)
              and file != "models/registry.py"]
    assert not direct, "modules importing a family folder directly:\n" + "\n".join(direct)


def test_functions_stay_short():
    """p99 of function length <= 60 lines (issue 12's bar; measured 50 when it was set): a long
    function is a sign that one place does several things."""
    lengths = sorted(node.end_lineno - node.lineno + 1 for path in PACKAGE_ROOT.rglob("*.py")
                     for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
    p99 = lengths[min(len(lengths) - 1, -(-99 * len(lengths) // 100) - 1)]
    assert len(lengths) > 500 and p99 <= 60, f"p99 function length {p99} lines over {len(lengths)} functions"
