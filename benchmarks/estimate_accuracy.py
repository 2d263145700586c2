"""The time estimate that `leakaudit validate` prints against the measured run, on the quickstart and on the starter
that docs/plugins.md's `leakaudit init` writes (and, with --realistic, configs/realistic_cnn16.yaml: 6 to 13 min on 2
cores), and the figures into docs/running.md.

    python benchmarks/estimate_accuracy.py              # quickstart and starter; rewrites docs/running.md's table
    python benchmarks/estimate_accuracy.py --realistic  # and realistic_cnn16
    python benchmarks/estimate_accuracy.py --check      # only prints

Each audit is estimated in a fresh cache (the calibration's own seconds are shown), then run with `leakaudit run`
in a subprocess from a fresh folder, as a user would (its estimate read from that cache). Run it alone on the machine: other work slows the run and
the calibration unequally.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stamp import ROOT, measured_on, write_block

RUNNING = ROOT / "docs" / "running.md"
STARTER = ["--defense", "dpsgd", "--defense", "soteria"]  # docs/plugins.md's command


def estimate(path: Path, cache: str) -> tuple[float, float, list[str]]:
    """The estimate's seconds, the seconds its calibration took (an empty cache), and the lines validate prints."""
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.estimate import estimate_audit

    os.environ["LEAKAUDIT_CACHE"] = cache
    audit = load_audit(path)
    start = time.perf_counter()
    predicted, _ = estimate_audit(audit)
    return predicted.total, time.perf_counter() - start, predicted.lines()


def measure(path: Path, cache: str) -> float:
    """Wall seconds of `leakaudit run` on a fresh folder (its estimate, already cached, costs it nothing)."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "leakaudit", "run", str(path), "--out", out, "--no-progress"],
                       capture_output=True, text=True, check=True, env={**os.environ, "LEAKAUDIT_CACHE": cache})
        return time.perf_counter() - start


def audits(folder: Path, realistic: bool) -> list[tuple[str, Path]]:
    """The audits compared: the quickstart, the starter written as docs/plugins.md says, the realistic one."""
    starter = folder / "starter.yaml"
    subprocess.run([sys.executable, "-m", "leakaudit", "init", str(starter), *STARTER], check=True,
                   capture_output=True, env={**os.environ, "LEAKAUDIT_ESTIMATE": "0"})
    out = [("quickstart", ROOT / "configs" / "quickstart.yaml"), ("starter (init " + " ".join(STARTER) + ")", starter)]
    return out + ([("realistic_cnn16", ROOT / "configs" / "realistic_cnn16.yaml")] if realistic else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--realistic", action="store_true", help="also configs/realistic_cnn16.yaml (13+ min)")
    parser.add_argument("--check", action="store_true", help="print, do not write")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, path in audits(Path(folder), args.realistic):
            with tempfile.TemporaryDirectory() as cache:
                predicted, calibration, lines = estimate(path, cache)
                seconds = measure(path, cache)
            print(f"{name}: estimated {predicted:.0f} s (calibration {calibration:.0f} s), measured {seconds:.0f} s, "
                  f"ratio {predicted / seconds:.2f}", *lines, sep="\n  ")
            rows.append(f"| {name} | {predicted:.0f} s | {seconds:.0f} s | {predicted / seconds:.2f} | "
                        f"{calibration:.0f} s |")
    table = "\n".join([f"Measured on {measured_on()} by benchmarks/estimate_accuracy.py:", "",
                       "| audit | estimate | measured run | estimate / run | calibration (first time) |",
                       "| --- | --- | --- | --- | --- |", *rows])
    print(table)
    if not args.check:
        write_block(RUNNING, "benchmarks/estimate_accuracy.py", table)


if __name__ == "__main__":
    main()
