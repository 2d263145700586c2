"""The package's layers: contracts at the bottom, families above, the engine on top, no import cycles; inside the
engine, rooms in order (the zoo, the audit file, results, running, live training, authoring, the command line);
no private name used outside its module.

Imports are read from the source (every ``import`` statement, also those inside functions), so a
lazy import that closes a cycle counts as one.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = {"plugins": "leakaudit.plugins", "defenses": "leakaudit.defenses", "attacks": "leakaudit.attacks",
         "evaluator": "leakaudit.evaluator", "leakaudit": "leakaudit"}


#: The engine's rooms, bottom first: a module imports from its own room and the rooms below it only.
ENGINE_ROOMS = ("zoo", "audit", "results", "run", "live", "authoring")


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in ROOMS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [*path.relative_to(ROOT / folder).parent.parts, path.stem]
            out[".".join([package, *parts[:-1]] + ([] if parts[-1] == "__init__" else [parts[-1]]))] = path
    return out


def _engine_room(module: str) -> int:
    """The rank of a module's engine room (the command line, at the top of evaluator/, above them all)."""
    parts = module.split(".")
    return ENGINE_ROOMS.index(parts[2]) if len(parts) > 3 else len(ENGINE_ROOMS)


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


def test_engine_rooms_import_only_their_own_and_those_below():
    for name, deps in GRAPH.items():
        if name.startswith("leakaudit.evaluator."):
            above = [d for d in deps if d.startswith("leakaudit.evaluator.") and _engine_room(d) > _engine_room(name)]
            assert not above, (name, above)


def _private_uses(path: Path, module: str) -> list[str]:
    """Private names (one leading underscore) this module takes from another leakaudit module, by import or as
    an attribute of an imported module."""
    found, aliases = [], {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("leakaudit") and node.module != module:
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name: a.name for a in node.names if a.name.startswith("leakaudit")}
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module():
    for name, path in _modules().items():
        assert not _private_uses(path, name), (name, _private_uses(path, name))


def _plugin_name_uses(path: Path, names: set[str], kinds: set[str]) -> list[str]:
    """Where a module decides by a built-in component's name: a comparison or membership test against the name,
    or a registry lookup of it (``registry.get("metric", "lpips")``), instead of the component's metadata."""
    def named(node) -> list[str]:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return [e.value for e in items if isinstance(e, ast.Constant) and e.value in names]

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            found += [f"line {node.lineno}: compares with {n!r}" for side in (node.left, *node.comparators)
                      for n in named(side)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in kinds):
            found += [f"line {node.lineno}: looks up {n!r}" for n in named(node.args[1])]
    return found


def test_the_engine_reads_metadata_not_component_names():
    """Outside the zoo, no module compares with or looks up a built-in component by name: metric direction, the
    report's second views, the identifying distance, the baseline defense, the Bayes adversary and Opacus's
    defense come from what each component declares (its defaults in the audit file aside)."""
    from leakaudit.plugins.manager import KINDS, load_registry

    registry = load_registry(entry_points=False)
    names = {n for kind in KINDS for n in registry.names(kind)} | {"fedsgd", "fedavg"}  # the protocols ("step" is too common a word)
    for name, path in _modules().items():
        if name.startswith("leakaudit.evaluator.") and ".zoo" not in name:
            assert not _plugin_name_uses(path, names, set(KINDS)), (name, _plugin_name_uses(path, names, set(KINDS)))


@functools.cache
def _calls_by_function(path: Path) -> dict[str, set[str]]:
    """Each function's (``Class.method``'s) callees by name: ``f(...)`` and ``x.f(...)`` both give ``f``."""
    out: dict[str, set[str]] = {}

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                name = f"{scope}.{child.name}" if scope else child.name
                if isinstance(child, ast.FunctionDef):
                    out[name] = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(child)
                                 if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
                visit(child, name)

    visit(ast.parse(path.read_text()), "")
    return out


def _callers(callee: str) -> set[str]:
    """The engine's modules that call ``callee`` anywhere."""
    return {name for name, path in _modules().items() if name.startswith("leakaudit.evaluator")
            and any(callee in calls for calls in _calls_by_function(path).values())}


def test_one_step_makes_every_row_and_every_guess():
    """One code path shapes results rows and scores the guesses: ``Row`` is made in run/step.py alone, the
    guesses are scored by the modality object alone, the ThreatModel is built by ``step.threat_model`` alone, no
    module shapes a row as a dict, and the runner's worker, audit_batch and every monitor reach ``step.judge_updates``."""
    assert _callers("Row") == {"leakaudit.evaluator.run.step"}
    assert _callers("guess_scores") | _callers("text_guess_scores") == {"leakaudit.evaluator.run.modality"}
    assert _callers("ThreatModel") == {"leakaudit.evaluator.run.step"}
    assert _callers("judge_updates") == {"leakaudit.evaluator.run.worker", "leakaudit.evaluator.live.api"}
    assert _callers("solve") & {n for n in _modules() if n.startswith("leakaudit.evaluator.live")} == set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            keys = {k.value for k in getattr(node, "keys", []) if isinstance(node, ast.Dict) and isinstance(k, ast.Constant)}
            assert not {"attack_name", "per_image"} <= keys, f"{name}: line {node.lineno} shapes a results row by hand"
    modules = _modules()
    worker = _calls_by_function(modules["leakaudit.evaluator.run.worker"])
    live = _calls_by_function(modules["leakaudit.evaluator.live.api"])
    core = _calls_by_function(modules["leakaudit.evaluator.live.core"])
    scenario = _calls_by_function(modules["leakaudit.evaluator.run.scenario"])
    assert "judge_updates" in worker["AuditWorker.attack"] and "judge_updates" in live["attack_shared"]
    assert "attack_shared" in live["_audit"] and "attack_shared" in core["MonitorCore._attack"]
    assert "threat_model" in scenario["Scenario.threat"] and "threat_model" in live["live_threat"]
    appended = [n for path in modules.values() for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "append"
                and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "results"]
    assert appended and all(isinstance(a.func, ast.Attribute) and a.func.attr == "to_json"
                            for call in appended for a in call.args if isinstance(a, ast.Call)), "rows are Row records"
    assert all(isinstance(a, ast.Call) for call in appended for a in call.args), "a results row is a Row's to_json()"
