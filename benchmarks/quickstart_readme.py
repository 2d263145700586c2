"""Run the quickstart as a new user does and write what it printed, and how long it took, into README.md.

    python benchmarks/quickstart_readme.py            # rewrites README.md's quickstart block and its time
    python benchmarks/quickstart_readme.py --check    # only prints them

The README's verdict lines are then the run's own (tests/test_quickstart.py fails when they drift), and its
time is this script's measurement: wall seconds of `leakaudit run configs/quickstart.yaml` with the default
workers, from a fresh folder and an empty analysis cache, as a new user's first run. Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMAND = "$ leakaudit run configs/quickstart.yaml --out runs/quickstart"
TIME = re.compile(r"\((?:under\s+a\s+minute|about\s+\d+\s+s)\s+on\s+\d+\s+CPU\s+cores.*?measured\s+by\s+"
                  r"benchmarks/quickstart_readme\.py\)", re.S)


def run_quickstart() -> tuple[list[str], float]:
    """The verdict lines the quickstart prints, and its wall seconds, as on a fresh install (an empty analysis
    cache)."""
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "leakaudit", "run", str(ROOT / "configs" / "quickstart.yaml"),
                               "--out", out, "--no-progress"], capture_output=True, text=True, check=True,
                              env={**os.environ, "LEAKAUDIT_CACHE": cache})
        seconds = time.perf_counter() - start
    return [line for line in done.stdout.splitlines() if line.startswith("  ")], seconds  # verdicts, reasons


def machine() -> str:
    """The CPU that produced the figures, and the kernels torch chose on it (another CPU's may round otherwise)."""
    import torch

    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    return f"{names[0] if names else 'unknown CPU'} ({torch.backends.cpu.get_cpu_capability()} kernels)"


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
    check = parser.parse_args().check
    verdicts, seconds = run_quickstart()
    print("\n".join(verdicts))
    print(f"quickstart: {seconds:.1f} s wall")
    if not check:
        README.write_text(rewrite(README.read_text(), verdicts, seconds))
        print(f"wrote {README}")


if __name__ == "__main__":
    main()
