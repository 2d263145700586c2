"""The package's layers: contracts at the bottom, families above, the engine on top, no import cycles.

Imports are read from the source (every ``import`` statement, also those inside functions), so a
lazy import that closes a cycle counts as one.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = {"plugins": "leakaudit.plugins", "defenses": "leakaudit.defenses", "attacks": "leakaudit.attacks",
         "evaluator": "leakaudit.evaluator", "leakaudit": "leakaudit"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in ROOMS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """The leakaudit modules ``path`` imports (``from pkg import mod`` resolved to the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("leakaudit")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("leakaudit"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found |= subs or {node.module}
    return found & known


GRAPH = {name: _imports(path, set(_modules())) for name, path in _modules().items()}


def test_nothing_imports_the_old_top_level_names():
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [m for m in mods if m.split(".")[0] in ("plugins", "defenses", "attacks", "evaluator")], name


def test_plugins_layer_imports_only_itself():
    for name, deps in GRAPH.items():
        if name.startswith("leakaudit.plugins"):
            assert all(d.startswith("leakaudit.plugins") for d in deps), (name, deps)


def test_families_never_import_the_engine():
    for name, deps in GRAPH.items():
        if name.startswith(("leakaudit.defenses", "leakaudit.attacks")):
            assert not [d for d in deps if d == "leakaudit" or d.startswith("leakaudit.evaluator")], (name, deps)
        if name.startswith("leakaudit.defenses"):
            assert not [d for d in deps if d.startswith("leakaudit.attacks")], (name, deps)


def test_no_import_cycles():
    graph = {n: {d for d in deps if d != "leakaudit"} for n, deps in GRAPH.items() if n != "leakaudit"}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
