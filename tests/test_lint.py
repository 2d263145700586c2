"""The code passes ruff (pyflakes and pycodestyle's errors, pyproject.toml's [tool.ruff]): no unused import, no
undefined name, no unreachable statement in any room, test, benchmark or example."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
