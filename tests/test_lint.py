"""The code passes ruff (pyflakes and pycodestyle's errors, pyproject.toml's [tool.ruff]): no unused import, no
undefined name, no unreachable statement in any room, test, benchmark or example."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing_in_the_whole_package(tmp_path):
    """The whole package type-checks (the facade, the contracts, the defenses, the attacks, every room of the
    engine, the testing helpers and the integrations' homes), as a regular install presents it (an editable
    install's import hook is invisible to type checkers); a plugin author's mypy then sees leakaudit.Defense as
    the class and each setting's type."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text("import leakaudit\nreveal_type(leakaudit.Defense)\n")
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--follow-imports=silent", "--python-executable", sys.executable, "leakaudit", str(probe)],
                          cwd=site, capture_output=True, text=True, env={**os.environ, "MYPYPATH": str(site)})
    assert 'Revealed type is "def (**settings: Any) -> leakaudit.plugins.defense.Defense"' in done.stdout, done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("Success"), done.stdout


@pytest.mark.slow
def test_mypy_follows_readmes_editable_install(tmp_path):
    """README's editable install (setuptools' strict mode: the package as a tree of links on a static .pth path)
    is one mypy follows: leakaudit.Defense is the class to it, as after a regular install (the default mode's
    import hook would leave it Any). Installed from a copy, since the links are built inside the source folder."""
    src, env = tmp_path / "src", tmp_path / "env"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "leakaudit", "plugins", "defenses", "attacks", "evaluator"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--ignore-installed", "--prefix", str(env), "--config-settings", "editable_mode=strict",
                    "-e", str(src)],  # --ignore-installed: never uninstall the leakaudit this suite runs on
                   check=True, capture_output=True)
    probe = tmp_path / "probe.py"
    probe.write_text("import leakaudit\nreveal_type(leakaudit.Defense)\n")
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--follow-imports=silent", "--python-executable", str(env / "bin" / "python"),
                           "--cache-dir", str(tmp_path / "cache"), str(probe)],
                          cwd=tmp_path, capture_output=True, text=True)
    assert 'Revealed type is "def (**settings: Any) -> leakaudit.plugins.defense.Defense"' in done.stdout, done.stdout
