"""The quickstart audit as a new user runs it: it breaks the undefended LeNet and strong noise stops it."""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import LEAKAUDIT, ROOT

pytestmark = pytest.mark.slow


def test_quickstart_end_to_end(tmp_path):
    out = tmp_path / "quickstart"
    done = subprocess.run([*LEAKAUDIT, "run", str(ROOT / "configs" / "quickstart.yaml"), "--out", str(out),
                           "--no-progress"], check=True, capture_output=True, text=True)
    for name in ("results.jsonl", "results.csv", "summary.json", "report.html", "privacy_utility.png",
                 "reconstructions_step0.png", "worst_images.png"):
        assert (out / name).stat().st_size > 0
    worst = {w["setting"]: w for w in json.loads((out / "summary.json").read_text())["worst_case"]}
    # the verdicts a team reads first, in the terminal and the summary
    assert worst["none"]["verdict"] == "leaks" and worst["gaussian(sigma=1.0)"]["verdict"] == "protects but unusable"
    terminal = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    assert " LEAKS " in terminal["none"] and " PROTECTS BUT UNUSABLE " in terminal["gaussian(sigma=1.0)"]
    # README.md shows what this run prints (benchmarks/quickstart_readme.py writes it from a run)
    readme = (ROOT / "README.md").read_text().splitlines()
    start = readme.index("$ leakaudit run configs/quickstart.yaml --out runs/quickstart") + 1
    shown = readme[start:readme.index("```", start)]
    assert shown == [line for line in done.stdout.splitlines() if line.startswith("  ")], \
        "README.md's quickstart block drifted from a fresh run: python benchmarks/quickstart_readme.py"
    undefended = worst["none"]["psnr"]
    assert undefended >= 18.0  # Geiping et al. 2020 Table 1: 18.00 dB for this attack on this untrained network
    assert worst["gaussian(sigma=1.0)"]["psnr"] <= undefended - 6.0
    assert worst["none"]["accuracy"] > worst["gaussian(sigma=1.0)"]["accuracy"]
