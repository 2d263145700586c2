"""How long each command takes to answer, beside ``python -c "import torch"``: the floor a command that needs
torch cannot go under; and an audit's fixed cost: a run of one target and one attack iteration.

    python benchmarks/cli_startup.py [--repeat 5]

Prints, per command, the median wall time of ``--repeat`` runs, its excess over ``import torch``, and which heavy
modules it imported (torch, matplotlib, scipy, the runner). The audit rows run with the default workers, with
``--workers 1``, with an empty analysis cache (the first audit of a model), with ``architecture: true`` (the
exact ranks of the report's architecture analysis, on an empty cache) and with a ``factory:`` model. Run it
alone on the machine: other work in parallel inflates every figure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import sys, runpy; sys.argv = ['leakaudit', *{args!r}]\n"
         "try:\n    runpy.run_module('leakaudit', run_name='__main__')\n"
         "except SystemExit:\n    pass\n"
         "heavy = [m for m in ('torch', 'matplotlib', 'scipy', 'leakaudit.evaluator.run.runner') if m in sys.modules]\n"
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
ONE_ITERATION = """name: one-iteration
data: {{dataset: digits, image_size: 32, targets: 1, batch_size: 1}}
model: {model}
defenses: [{{name: none}}]
attacks: [{{name: inverting_gradients, params: {{iterations: 1}}}}]
utility: {{train_steps: 0}}
metrics: [psnr]
architecture: {architecture}
"""
FACTORY = """import torch
from torch import nn


def build(num_classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 12, 5, padding=2), nn.Sigmoid(), nn.Flatten(), nn.Linear(12 * 32 * 32, num_classes))
"""
LENET = "{name: lenet_zhu, checkpoints: [0]}"
AUDITS = {  # row: (model, architecture, extra arguments, fresh analysis cache)
    "1-iteration audit, default workers": (LENET, "auto", [], False),
    "1-iteration audit, --workers 1": (LENET, "auto", ["--workers", "1"], False),
    "1-iteration audit, empty analysis cache": (LENET, "auto", [], True),
    "1-iteration audit, architecture: true": (LENET, "true", [], True),
    "1-iteration audit, factory: model": ("{factory: 'tiny_model:build', checkpoints: [0]}", "auto", [], True),
}


def timed(args: list[str] | None, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Wall seconds of one fresh interpreter running the command, and the heavy modules it imported."""
    code = "import torch" if args is None else PROBE.format(args=args)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - start
    if args and args[0] == "run" and "--out" in args and "wrote " not in done.stdout:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    imported = next((line.split(":", 1)[1] for line in done.stderr.splitlines() if line.startswith("IMPORTED:")), "")
    return seconds, imported or "-"


def audit_runs(folder: Path, repeat: int) -> dict[str, list[tuple[float, str]]]:
    """Each AUDITS row ``repeat`` times, each run into a fresh folder (and cache where the row asks)."""
    (folder / "tiny_model.py").write_text(FACTORY)
    out: dict[str, list[tuple[float, str]]] = {}
    for i, (name, (model, architecture, extra, fresh)) in enumerate(AUDITS.items()):
        path = folder / f"audit{i}.yaml"
        path.write_text(ONE_ITERATION.format(model=model, architecture=architecture))
        out[name] = []
        for r in range(repeat):
            env = {"LEAKAUDIT_CACHE": str(folder / f"cache{i}-{r}" if fresh else folder / "cache")}
            out[name].append(timed(["run", str(path), "--out", str(folder / f"run{i}-{r}"), "--no-progress", *extra], env))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    repeat = parser.parse_args().repeat
    runs = {name: [timed(args) for _ in range(repeat)] for name, args in COMMANDS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        runs |= audit_runs(Path(tmp), repeat)
    floor = statistics.median(s for s, _ in runs["import torch"])
    print(f"{'command':<45} {'median s':>9} {'- torch':>8}  heavy modules imported")
    for name, got in runs.items():
        median = statistics.median(s for s, _ in got)
        print(f"{name:<45} {median:>9.2f} {median - floor:>+8.2f}  {got[-1][1]}")


if __name__ == "__main__":
    main()
