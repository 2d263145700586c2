"""What the benchmarks share: the machine a figure was measured on, and the marked blocks of the docs they
rewrite, so that every time the docs state is a measurement with its machine beside it."""
from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """The CPU that produced the figures, and the kernels torch chose on it (another CPU's may round otherwise)."""
    import torch

    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    return f"{names[0] if names else 'unknown CPU'} ({torch.backends.cpu.get_cpu_capability()} kernels)"


def measured_on() -> str:
    """One phrase for a figure's provenance: cores, CPU, kernels and the day."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} CPU cores of an {machine()}, {datetime.date.today().isoformat()}"


def write_block(path: Path, script: str, text: str) -> None:
    """Replace what lies between ``<!-- written by SCRIPT -->`` and ``<!-- end SCRIPT -->`` in ``path``."""
    start, end = f"<!-- written by {script} -->", f"<!-- end {script} -->"
    old = path.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(old):
        raise SystemExit(f"{path}: no block marked {start} ... {end} to rewrite")
    path.write_text(pattern.sub(lambda _: f"{start}\n{text.strip()}\n{end}", old, count=1))
