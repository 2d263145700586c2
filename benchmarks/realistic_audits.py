"""Wall time and verdicts of the realistic audits (``attacks: auto``), measured run by run and compared in a table.

Each run is ``leakaudit run CONFIG`` in a fresh process, timed from start to report, with its verdicts read from
summary.json (per setting and step: verdict, what leaks, the strongest attack and its score). ``--label`` names the
code measured (``before`` for an older checkout's interpreter given by ``--leakaudit``, ``after`` for this one);
each run is added to ``--record`` as it finishes, so an interrupted series keeps what it measured. ``--table``
writes the record's before/after table into docs/results.md between its markers, with this machine's name.

    python benchmarks/realistic_audits.py --label after [--leakaudit PATH] [--configs a.yaml b.yaml]
    python benchmarks/realistic_audits.py --table
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from leakaudit.evaluator.audit.budget import skipped_of

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["configs/realistic_cnn16.yaml", "configs/realistic_mlp64.yaml", "configs/realistic_clients.yaml"]
RECORD = ROOT / "benchmarks" / "results" / "realistic_audits.json"
RESULTS = ROOT / "docs" / "results.md"
BEGIN, END = "<!-- realistic_audits.py: begin -->", "<!-- realistic_audits.py: end -->"


def run_one(leakaudit: str, config: str, out: Path) -> dict:
    """One audit run from scratch in its own process: its wall seconds and its verdicts."""
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    started = time.perf_counter()
    done = subprocess.run([leakaudit, "run", config, "--out", str(out), "--no-progress"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{config}: leakaudit run exited {done.returncode}: {done.stderr.strip()[-400:]}")
    summary = json.loads((out / "summary.json").read_text())
    verdicts = {f"{v['setting']} @ {v['checkpoint']}": {
        "verdict": v["verdict"], "level": v.get("level"), "attack": v["attack"], "score": round(v["score"], 2)}
        for v in summary["verdicts"]}
    skipped = skipped_of(summary["run"])
    return {"config": config, "seconds": round(seconds, 1), "verdicts": verdicts, "skipped": len(skipped),
            "date": time.strftime("%Y-%m-%d")}


def machine() -> str:
    """The CPU and core count the figures were measured on."""
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores of an {name}"


def measure(args: argparse.Namespace) -> None:
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {"machine": machine(), "runs": []}
    for config in args.configs:
        result = {"label": args.label, **run_one(args.leakaudit, config, Path(args.out) / args.label / Path(config).stem)}
        record["runs"] = [r for r in record["runs"] if (r["label"], r["config"]) != (args.label, config)] + [result]
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{args.label} {config}: {result['seconds'] / 60:.1f} min, {result['skipped']} cells skipped", flush=True)


def verdict_text(v: dict) -> str:
    level = f" {v['level']}" if v["verdict"] == "leaks" and v.get("level") else ""
    return f"{v['verdict']}{level}"


def table() -> str:
    """The record as a markdown table: per audit, each code's minutes and whether the verdicts are the same."""
    record = json.loads(RECORD.read_text())
    runs = {(r["label"], r["config"]): r for r in record["runs"]}
    dates = sorted({r.get("date", "undated") for r in record["runs"]})
    lines = [f"Measured by `benchmarks/realistic_audits.py` on {record['machine']} (2 worker processes), "
             f"{', '.join(dates)}.", "",
             "| audit | before, min | after, min | after / before | verdicts (setting @ step) | same verdicts |",
             "| --- | --- | --- | --- | --- | --- |"]
    for config in dict.fromkeys(r["config"] for r in record["runs"]):
        before, after = runs.get(("before", config)), runs.get(("after", config))
        if before is None or after is None:
            continue
        same = all(verdict_text(before["verdicts"][k]) == verdict_text(v) for k, v in after["verdicts"].items()) \
            and before["verdicts"].keys() == after["verdicts"].keys()
        shown = "; ".join(f"{k}: {verdict_text(v)} ({v['attack']} {v['score']:.1f})" for k, v in after["verdicts"].items())
        lines.append(f"| `{Path(config).stem}` | {before['seconds'] / 60:.1f} | {after['seconds'] / 60:.1f} | "
                     f"{after['seconds'] / before['seconds']:.2f} | {shown} | {'yes' if same else 'no'} |")
    return "\n".join(lines)


def write_table() -> None:
    text = RESULTS.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{RESULTS}: no {BEGIN} ... {END} markers to write the table between")
    head, rest = text.split(BEGIN, 1)
    RESULTS.write_text(f"{head}{BEGIN}\n{table()}\n{END}{rest.split(END, 1)[1]}")
    print(table())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", choices=["before", "after"], default="after")
    parser.add_argument("--leakaudit", default=str(Path(sys.executable).with_name("leakaudit")),
                        help="the leakaudit command to measure (an older checkout's, for before)")
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--out", default=str(ROOT / "runs" / "realistic_audits"))
    parser.add_argument("--table", action="store_true", help="write the record's table into docs/results.md")
    args = parser.parse_args()
    write_table() if args.table else measure(args)


if __name__ == "__main__":
    main()
