"""The code passes ruff (pyflakes and pycodestyle's errors, pyproject.toml's [tool.ruff]): no unused import, no
undefined name, no unreachable statement in any room, test, benchmark or example."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing_in_what_plugin_authors_import(tmp_path):
    """The facade, the contracts (plugins/), the defenses, the attacks, the testing helpers and the integrations'
    homes type-check, as a regular install presents them (an editable install's import hook is invisible to type
    checkers); a plugin author's mypy then sees leakaudit.Defense as the class and each setting's type."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text("import leakaudit\nreveal_type(leakaudit.Defense)\n")
    checked = ["leakaudit/__init__.py", "leakaudit/plugins", "leakaudit/defenses", "leakaudit/attacks",
               "leakaudit/testing.py", "leakaudit/flower.py", "leakaudit/lightning.py"]
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--follow-imports=silent", "--python-executable", sys.executable, *checked, str(probe)],
                          cwd=site, capture_output=True, text=True, env={**os.environ, "MYPYPATH": str(site)})
    assert 'Revealed type is "def (**settings: Any) -> leakaudit.plugins.defense.Defense"' in done.stdout, done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("Success"), done.stdout
