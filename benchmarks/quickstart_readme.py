"""Run the quickstart as a new user does and write what it printed, and how long it took, into README.md and
docs/results.md.

    python benchmarks/quickstart_readme.py            # rewrites README.md's quickstart block and its time
    python benchmarks/quickstart_readme.py --check    # only prints them
    python benchmarks/quickstart_readme.py --text     # the text quickstart's time and verdicts, in docs/results.md

The README's verdict lines are then the run's own (tests/test_quickstart.py fails when they drift), and its
time is this script's measurement: wall seconds of `leakaudit run configs/quickstart.yaml` with the default
workers, from a fresh folder and an empty analysis cache, as a new user's first run. Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stamp import ROOT, machine, measured_on, write_block

README = ROOT / "README.md"
COMMAND = "$ leakaudit run configs/quickstart.yaml --out runs/quickstart"
TIME = re.compile(r"\((?:under\s+a\s+minute|about\s+\d+\s+s)\s+on\s+\d+\s+CPU\s+cores.*?measured\s+by\s+"
                  r"benchmarks/quickstart_readme\.py\)", re.S)


def run_quickstart(config: str = "quickstart.yaml") -> tuple[list[str], list[dict], float]:
    """The verdict lines a quickstart prints, its summary's worst cases, and its wall seconds, as on a fresh
    install (an empty analysis cache)."""
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "leakaudit", "run", str(ROOT / "configs" / config),
                               "--out", out, "--no-progress"], capture_output=True, text=True, check=True,
                              env={**os.environ, "LEAKAUDIT_CACHE": cache})
        seconds = time.perf_counter() - start
        summary = json.loads((Path(out) / "summary.json").read_text())
        cells = {(c["setting"], c["attack"], c["checkpoint"]): c for c in summary["cells"]}
        worst = [{**w, "cell": cells.get((w["setting"], w["attack"], w["checkpoint"]), {})}
                 for w in summary["worst_case"]]  # each worst case with its strongest attack's cell
    shown = [line for line in done.stdout.splitlines() if line.startswith(("  ", "decision:", "frontier "))]
    return shown, worst, seconds  # each verdict with its reason, then the decision


def results_block(worst: list[dict], seconds: float) -> str:
    """docs/results.md's quickstart table and time: the same run as README.md's block."""
    rows = [f"| {w['setting']} | {w['accuracy']:.3f} | {w['psnr']:.3g} [{w['psnr_ci'][0]:.3g}, {w['psnr_ci'][1]:.3g}]"
            f" | {w['verdict']} |" for w in worst]
    return "\n".join([f"{round(seconds)} s of wall time on {measured_on()}, on a fresh install (an empty analysis cache).",
                      "Worst-case PSNR as the run prints it (README.md shows the same lines):", "",
                      "| setting | test accuracy | PSNR (dB) [95% CI] | verdict |", "| --- | --- | --- | --- |", *rows])


def text_block(worst: list[dict], decision: str, seconds: float) -> str:
    """docs/results.md's text quickstart: its time, each setting's verdict with its strongest attack's ROUGE-1
    and PII recall, and the decision, as the run printed them."""
    def cell(value: float | None, ci: list[float] | None = None) -> str:
        if value is None:
            return "n/a"
        return f"{value:.3f}" + ("" if not ci else f" [{ci[0]:.3f}, {ci[1]:.3f}]")

    rows = [f"| {w['setting']} | {w['verdict']}{' (' + w['level'] + ')' if w.get('level') else ''} | {w['attack']} | "
            f"{cell(w.get('rouge1'), w.get('rouge1_ci'))} | {cell(w['cell'].get('pii_recall'))} | "
            f"{cell(w.get('accuracy'))} |"
            for w in worst]
    return "\n".join([
        "```bash", "leakaudit run configs/text_quickstart.yaml --out runs/text_quickstart", "```", "",
        f"{round(seconds)} s of wall time ({seconds / 60:.1f} min) on {measured_on()}, on a fresh install. Each "
        "setting's verdict and its strongest attack, as the run printed them:", "",
        "| setting | verdict (level) | strongest attack | its ROUGE-1 [95% CI] | its PII recall | accuracy |",
        "| --- | --- | --- | --- | --- | --- |", *rows, "", f"The run's {decision}"])


def readme_block(text: str) -> list[str]:
    """The verdict lines README.md shows under the quickstart's command."""
    lines = text.splitlines()
    start = lines.index(COMMAND) + 1
    end = lines.index("```", start)
    return lines[start:end]


def rewrite(text: str, verdicts: list[str], seconds: float) -> str:
    """README.md's text with the run's verdict lines and time in place of the old."""
    lines = text.splitlines()
    start = lines.index(COMMAND) + 1
    end = lines.index("```", start)
    lines[start:end] = verdicts
    stated = (f"(about {round(seconds)} s on {os.cpu_count()} CPU cores of an {machine()}, measured by "
              "benchmarks/quickstart_readme.py)")
    return TIME.sub(stated, "\n".join(lines) + "\n", count=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print, do not write")
    parser.add_argument("--text", action="store_true", help="the text quickstart, into docs/results.md")
    args = parser.parse_args()
    check = args.check
    if args.text:
        verdicts, worst, seconds = run_quickstart("text_quickstart.yaml")
        print("\n".join(verdicts))
        print(f"text quickstart: {seconds:.1f} s wall on {measured_on()}")
        decision = next((line for line in verdicts if line.startswith("decision:")), "decision: none printed")
        if not check:
            write_block(ROOT / "docs" / "results.md", "benchmarks/quickstart_readme.py (text)",
                        text_block(worst, decision, seconds))
            print("wrote docs/results.md")
        return
    verdicts, worst, seconds = run_quickstart()
    print("\n".join(verdicts))
    print(f"quickstart: {seconds:.1f} s wall on {measured_on()}")
    if not check:
        README.write_text(rewrite(README.read_text(), verdicts, seconds))
        write_block(ROOT / "docs" / "results.md", "benchmarks/quickstart_readme.py", results_block(worst, seconds))
        print(f"wrote {README} and docs/results.md")


if __name__ == "__main__":
    main()
