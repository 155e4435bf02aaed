"""The house rules of the package layout, checked on every import statement (function-local ones
included): no import cycle between subpackages, and project imports at module top outside ``cli/``.

The layers, top to bottom: cli -> features (bench, calibrate, train, pack, convert, encode) -> data ->
profile -> balance / models -> parallel -> config. A new arrow that points back up shows as a
cycle here, with the modules that make it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import loongforge

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


def _project_imports():
    """(subpackage, file, imported module, inside a function) for every loongforge import."""
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        relative = path.relative_to(PACKAGE_ROOT)
        subpackage = relative.parts[0] if len(relative.parts) > 1 else None
        module = _module_name(path)
        tree = ast.parse(path.read_text())
        in_function: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(child) for child in ast.walk(node) if child is not node)
        for node in ast.walk(tree):
            for name in _imported_modules(node, module, path.name == "__init__.py"):
                if name.startswith("loongforge."):
                    yield subpackage, str(relative), name, id(node) in in_function


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


def test_project_imports_are_at_module_top_outside_cli():
    local = [f"{file}: {name}" for subpackage, file, name, inside in _project_imports()
             if inside and subpackage not in LAZY_IMPORTS_ALLOWED]
    assert not local, "project imports inside functions (move them to the module top):\n" + "\n".join(local)


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


def test_models_outside_the_family_folders_name_no_family():
    """The rest of the code reaches a model family through ``models.registry`` only."""
    families = [p.name for p in (PACKAGE_ROOT / "models").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()]
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
