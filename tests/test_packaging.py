"""leakaudit installs as one import name and runs beside a user's own modules called evaluator and plugins."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

import leakaudit

from conftest import ROOT, small_audit

SOURCES = ("pyproject.toml", "README.md", "leakaudit", "plugins", "defenses", "attacks", "evaluator")


def _run(cmd, **kwargs):
    """``cmd`` without an inherited PYTHONPATH (Flower's simulation sets one to this process's sys.path): the
    fresh environment must see only what it holds and what its .pth file borrows."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, **kwargs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    """A new virtual environment with the built wheel, its dependencies borrowed from this one."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
            ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}))
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp / "dist"), str(src)])
    (wheel,) = (tmp / "dist").glob("leakaudit-*.whl")
    env = tmp / "env"
    _run([sys.executable, "-m", "venv", str(env)])
    python = env / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    before = {p.name for p in (tmp / "env").rglob("site-packages") for p in p.iterdir()}
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)])
    added = {p.name for p in (tmp / "env").rglob("site-packages") for p in p.iterdir()} - before
    # torch, opacus and the rest come from the test environment's site-packages, after the new one
    (env / "lib" / site.split("/lib/")[-1] / "zz_test_dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    return env, python, added


@pytest.mark.slow
def test_the_wheel_puts_only_leakaudit_at_the_top_of_site_packages(fresh_env):
    _, _, added = fresh_env
    assert {n for n in added if not n.endswith(".dist-info")} == {"leakaudit"}
    assert [n for n in added if n.endswith(".dist-info")] == [f"leakaudit-{leakaudit.__version__}.dist-info"]
    python = fresh_env[1]  # the wheel carries the corpus and its licence
    assert _run([str(python), "-c", "from leakaudit.evaluator.zoo.text import CORPUS, load_python_reference; "
                 "print(len(load_python_reference().train_x), CORPUS.with_name('PSF-LICENSE.txt').exists())"
                 ], cwd=fresh_env[0]).stdout.split() == ["305", "True"]


@pytest.mark.slow
def test_a_tiny_audit_runs_from_a_folder_with_its_own_evaluator_and_plugins(fresh_env, tmp_path):
    env, python, _ = fresh_env
    (tmp_path / "evaluator.py").write_text("raise RuntimeError('the user evaluator module was imported')\n")
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "__init__.py").write_text("raise RuntimeError('the user plugins package was imported')\n")
    (tmp_path / "my_plugins").mkdir()
    (tmp_path / "my_plugins" / "double.py").write_text(textwrap.dedent("""
        from leakaudit import DeterministicDefense, hookimpl

        class Double(DeterministicDefense):
            '''Sends twice the update (a user's drop-in defense).'''
            name = "double"

            def transform(self, update):
                return [2 * t for t in update]

        @hookimpl
        def register_defenses():
            return [Double]
    """))
    audit = small_audit(defenses=[{"name": "none"}, {"name": "double"}], plugins_dir="my_plugins",
                        utility={"train_steps": 0})
    (tmp_path / "audit.yaml").write_text(json.dumps(audit))
    where = _run([str(python), "-c", "import leakaudit, leakaudit.evaluator.run.runner; print(leakaudit.__file__)"],
                 cwd=tmp_path).stdout.strip()
    assert where.startswith(str(env))
    assert _run([str(env / "bin" / "leakaudit"), "--version"], cwd=tmp_path).stdout.strip() == \
        f"leakaudit {leakaudit.__version__}"
    _run([str(env / "bin" / "leakaudit"), "run", "audit.yaml", "--out", "out", "--no-progress"], cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert {r["setting"] for r in rows} == {"none", "double"} and len(rows) == 4
    assert (tmp_path / "out" / "report.html").exists()


@pytest.mark.slow
def test_import_leakaudit_gives_the_public_api():
    proc = _run([sys.executable, "-c", "import leakaudit; print(leakaudit.__version__); "
                 "print(all(hasattr(leakaudit, n) for n in leakaudit.__all__))"])
    version, complete = proc.stdout.split()
    assert version == leakaudit.__version__ != "0+unknown" and complete == "True"


def test_type_checkers_see_every_public_name_where_it_is_imported_from():
    """The facade's TYPE_CHECKING imports name each lazily imported name from its own module (a checker then sees
    leakaudit.Defense as the class, not Any), and the package ships py.typed (PEP 561)."""
    import ast

    tree = ast.parse((ROOT / "leakaudit" / "__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.name: node.module for node in guarded.body for alias in node.names}
    assert seen == leakaudit._LAZY
    assert all(alias.asname == alias.name for node in guarded.body for alias in node.names)  # re-exported
    assert (ROOT / "leakaudit" / "py.typed").exists()
