"""What the docs show is what the code takes: every audit file in README.md and docs/ validates as written, a
fragment of one names only keys an audit file has, and the documentation site builds with its reference
generated from the code, nothing in it undocumented."""
from __future__ import annotations

import os
import re
import textwrap
import shutil

import pytest
import yaml

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.specs import TOP

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page, i, block) for page in PAGES
          for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S))]


def test_the_docs_hold_yaml_blocks():
    assert {p.name for p, _, _ in BLOCKS} >= {"audit-file.md", "own-training.md", "cluster.md"}


def test_readme_is_what_a_visitor_needs_and_links_every_page():
    """README.md stays short (what it is, the two commands, the quickstart's output, links); the reference lives
    in docs/, each page linked from it."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 10_000
    assert all(f"docs/{page.name}" in readme for page in (ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{p.name}[{i}]" for p, i, _ in BLOCKS])
def test_every_yaml_block_of_the_docs_validates(tmp_path, page, index, block):
    content = yaml.safe_load(block)
    assert isinstance(content, dict) and set(content) <= set(TOP), f"{page.name}: unknown keys {set(content) - set(TOP)}"
    if not {"name", "defenses"} <= set(content):
        return  # a fragment: its keys are an audit file's
    (tmp_path / "my_plugins").mkdir()
    for module in (ROOT / "examples" / "own_training").glob("*.py"):  # the factories the pages name
        shutil.copy(module, tmp_path)
    path = tmp_path / "audit.yaml"
    path.write_text(block)
    audit = load_audit(path, import_user_code=False)
    assert audit.settings and audit.attacks


def _reference():
    """docs/gen_reference.py, which generates the site's reference pages (docs/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_documentation_site_builds_with_warnings_as_errors(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    keys = (tmp_path / "site" / "reference" / "audit-keys" / "index.html").read_text()
    assert "precision" in keys and "local_epochs" in keys  # a top-level key and a protocol's
    assert "frozen_embeddings" in (tmp_path / "site" / "reference" / "builtins" / "index.html").read_text()
    assert "--fail-on-leak" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "register_defenses" in (tmp_path / "site" / "reference" / "hooks" / "index.html").read_text()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "leakaudit.run_audit" in api and not re.search(r" at 0x[0-9a-f]{6,}", api)  # the same page every build


def test_every_key_built_in_flag_hook_and_exported_name_has_its_doc(monkeypatch):
    """The reference is generated, so what lacks a doc shows up empty: the check names it."""
    reference = _reference()
    assert reference.undocumented() == []
    from leakaudit.plugins.spec import Param

    monkeypatch.setitem(TOP, "undocumented_key", Param(0, int))
    assert reference.undocumented() == ["audit key Top level.undocumented_key"]


def test_the_entry_points_docstrings_give_every_argument_what_they_return_raise_and_an_example():
    """The functions of the public API and LeakMonitor: Args names exactly the signature's parameters, Returns
    (for a function), Raises and an Example come in that order, and the API page renders them as lists and a
    Python block."""
    import inspect

    import leakaudit

    reference = _reference()
    for name in ("load_audit", "run_audit", "report_folder", "load_registry", "audit_batch", "LeakMonitor"):
        obj = getattr(leakaudit, name)
        parts = reference.sections(inspect.getdoc(obj))
        wanted = ["Args", "Raises", "Example"] if inspect.isclass(obj) else ["Args", "Returns", "Raises", "Example"]
        assert [k for k in parts if k] == wanted, name
        params = [p for p in inspect.signature(obj).parameters if p != "self"]
        assert list(reference.entries(parts["Args"])) == params, name
        assert all(text for text in reference.entries(parts["Args"]).values()), name
        assert "```python" in reference._doc(obj, name) and f"leakaudit.{name}(" in "\n".join(parts["Example"]), name


PYTHON_BLOCKS = [(page, i, textwrap.dedent(block)) for page in PAGES
                 for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]


@pytest.mark.parametrize("page, index, block", PYTHON_BLOCKS, ids=[f"{p.name}[{i}]" for p, i, _ in PYTHON_BLOCKS])
def test_every_python_block_of_the_docs_imports_what_it_names_and_calls_it_as_it_takes(page, index, block):
    """A snippet stands in a user's code (their model, their loader), so it is not run; what it takes from
    leakaudit is checked: it parses, its imports import, and each call of an imported name passes keywords the
    callable accepts."""
    import ast
    import importlib
    import inspect

    tree = ast.parse(block, f"{page.name}[{index}]")
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("leakaudit"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                names[alias.asname or alias.name] = getattr(module, alias.name)  # AttributeError: a stale name
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            target = names[node.func.id]
            parameters = inspect.signature(target).parameters
            if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                continue
            unknown = [k.arg for k in node.keywords if k.arg and k.arg not in parameters]
            assert not unknown, f"{page.name}[{index}]: {node.func.id} takes no {unknown}"
