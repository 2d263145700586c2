"""``workers: auto`` against fixed worker counts, on the quickstart and on a drop-in plugin audit: wall time of
each, and whether their results agree.

    python benchmarks/workers_auto.py            # prints the table and rewrites its block in docs/results.md
    python benchmarks/workers_auto.py --check    # only prints it

Each audit runs with ``--workers 1``, ``--workers 2`` and the default (auto), each into a fresh folder with a warm
analysis cache (a first run fills it), and ``leakaudit analyse`` runs on an empty one. Auto should be within
1.25x of the best fixed choice; every choice must give the same verdicts (workers split the work, never the
random draws; their threads change the order of floating-point sums, and the table says how far that moved the
numbers). Run it alone on the machine: other work in parallel inflates every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stamp import ROOT, measured_on, write_block

#: The drop-in plugin: the plugin template's logistic defense, as `leakaudit new-plugin` writes it.
PLUGIN = ROOT / "examples" / "plugin-template" / "src" / "leakaudit_logistic" / "__init__.py"
#: The plugin audit of the report that asked for this benchmark: 2 targets, 300 iterations, 100 training steps.
PLUGIN_AUDIT = """name: plug
plugins_dir: plug
seed: 0
data: {dataset: digits, image_size: 32, targets: 2, batch_size: 1}
model: {name: lenet_zhu, checkpoints: [0]}
defenses: [{name: none}, {name: logistic, params: {scale: 0.1}}]
attacks:
  - {name: inverting_gradients, params: {iterations: 300, lr: 0.1, priors: {tv: 0.01}}}
  - {name: bayes, defenses: [logistic]}
utility: {train_steps: 100}
metrics: [psnr, ssim, label_accuracy]
"""
CHOICES = {"--workers 1": ["--workers", "1"], "--workers 2": ["--workers", "2"], "auto": []}
NUMBERS = ("psnr", "ssim", "label_accuracy")


def leakaudit(args: list[str], cache: Path) -> tuple[float, str]:
    """Wall seconds of one ``leakaudit`` command in a fresh interpreter, and what it printed."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "leakaudit", *args], capture_output=True, text=True,
                          env={**os.environ, "LEAKAUDIT_CACHE": str(cache)})
    if done.returncode:
        raise SystemExit(f"leakaudit {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return time.perf_counter() - start, done.stdout


def outcome(out: Path) -> tuple[dict[str, str], dict[tuple, float]]:
    """A run's verdicts, and its numbers by row and name (the attack rows' scores, each setting's accuracy)."""
    summary = json.loads((out / "summary.json").read_text())
    verdicts = {w["setting"]: w["verdict"] for w in summary["worst_case"]}
    numbers = {(r["setting"], r["attack"], r["checkpoint"], r["target"], m): r[m]
               for r in map(json.loads, (out / "results.jsonl").read_text().splitlines()) for m in NUMBERS}
    numbers |= {(u["setting"], "accuracy"): u["accuracy"]
                for u in map(json.loads, (out / "utility.jsonl").read_text().splitlines())}
    return verdicts, numbers


def compare(audit: Path, folder: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Each worker choice's wall seconds on ``audit``, and the largest difference of each number between the
    choices; stops where their verdicts differ (a worker count moves floating-point sums, never a verdict)."""
    cache = folder / "cache"
    leakaudit(["run", str(audit), "--out", str(folder / "warm"), "--no-progress"], cache)  # fills the cache
    seconds, outcomes = {}, {}
    for name, extra in CHOICES.items():
        out = folder / name.replace(" ", "").replace("-", "")
        seconds[name], _ = leakaudit(["run", str(audit), "--out", str(out), "--no-progress", *extra], cache)
        outcomes[name] = outcome(out)
    (verdicts, numbers), *others = outcomes.values()
    if any(v != verdicts for v, _ in others):
        raise SystemExit(f"{audit.name}: the worker choices gave different verdicts: "
                         f"{ {name: v for name, (v, _) in outcomes.items()} }")
    moved: dict[str, float] = {}
    for _, other in others:
        for key, value in numbers.items():
            if isinstance(value, float) and isinstance(other.get(key), float):
                moved[key[-1]] = max(moved.get(key[-1], 0.0), abs(value - other[key]))
    return seconds, moved


def table(times: dict[str, tuple[dict[str, float], dict[str, float]]], analyse: float) -> str:
    """The markdown block: seconds per choice, auto's ratio to the best fixed choice, what the choice moved."""
    lines = [f"Measured by `benchmarks/workers_auto.py` on {measured_on()}; wall seconds of `leakaudit run` with "
             "a warm analysis cache. Every choice gave the same verdicts; the last column is the most any number "
             "moved between choices (threads per process change the order of floating-point sums):", "",
             "| audit | --workers 1 | --workers 2 | auto | auto / best fixed | largest difference |",
             "| --- | --- | --- | --- | --- | --- |"]
    for audit, (s, moved) in times.items():
        best = min(s["--workers 1"], s["--workers 2"])
        shown = ", ".join(f"{name} {value:.2g}" for name, value in sorted(moved.items())) or "none"
        lines.append(f"| {audit} | {s['--workers 1']:.1f} | {s['--workers 2']:.1f} | {s['auto']:.1f} | "
                     f"{s['auto'] / best:.2f} | {shown} |")
    lines += ["", f"`leakaudit analyse configs/quickstart.yaml` on an empty analysis cache (the architecture "
                  f"analysis of `lenet_zhu` at 32x32, cached after): {analyse:.1f} s."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print, do not write")
    check = parser.parse_args().check
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "plug").mkdir()
        (tmp / "plug" / "logistic.py").write_text(PLUGIN.read_text())
        (tmp / "plug.yaml").write_text(PLUGIN_AUDIT)
        times = {}
        for name, audit in {"quickstart": ROOT / "configs" / "quickstart.yaml",
                            "drop-in plugin (2 targets, 300 iterations, 100 steps)": tmp / "plug.yaml"}.items():
            (tmp / name[:5]).mkdir()
            times[name] = compare(audit, tmp / name[:5])
        analyse, _ = leakaudit(["analyse", str(ROOT / "configs" / "quickstart.yaml")], tmp / "empty-cache")
    block = table(times, analyse)
    print(block)
    if not check:
        write_block(ROOT / "docs" / "results.md", "benchmarks/workers_auto.py", block)
        print("wrote docs/results.md")


if __name__ == "__main__":
    main()
