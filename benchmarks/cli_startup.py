"""How long each command takes to answer, beside ``python -c "import torch"``: the floor a command that needs
torch cannot go under.

    python benchmarks/cli_startup.py [--repeat 5]

Prints, per command, the median wall time of ``--repeat`` runs and which heavy modules it imported (torch,
matplotlib, the runner). Run it alone on the machine: other work in parallel inflates every figure.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import sys, runpy; sys.argv = ['leakaudit', *{args!r}]\n"
         "try:\n    runpy.run_module('leakaudit', run_name='__main__')\n"
         "except SystemExit:\n    pass\n"
         "heavy = [m for m in ('torch', 'matplotlib', 'leakaudit.evaluator.runner') if m in sys.modules]\n"
         "print('IMPORTED:' + ','.join(heavy), file=sys.stderr)")
COMMANDS = {
    "import torch": None,
    "leakaudit --help": ["--help"],
    "leakaudit --version": ["--version"],
    "leakaudit run --help": ["run", "--help"],
    "leakaudit schema": ["schema"],
    "leakaudit plugins": ["plugins"],
    "leakaudit validate configs/quickstart.yaml": ["validate", str(ROOT / "configs" / "quickstart.yaml")],
}


def timed(args: list[str] | None) -> tuple[float, str]:
    """Wall seconds of one fresh interpreter running the command, and the heavy modules it imported."""
    code = "import torch" if args is None else PROBE.format(args=args)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    imported = next((line.split(":", 1)[1] for line in done.stderr.splitlines() if line.startswith("IMPORTED:")), "")
    return seconds, imported or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    repeat = parser.parse_args().repeat
    print(f"{'command':<45} {'median s':>9}  heavy modules imported")
    for name, args in COMMANDS.items():
        runs = [timed(args) for _ in range(repeat)]
        print(f"{name:<45} {statistics.median(s for s, _ in runs):>9.2f}  {runs[-1][1]}")


if __name__ == "__main__":
    main()
