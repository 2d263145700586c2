"""Settled and budgeted runs against the full run of the same file, verdict by verdict: never kinder.

Each audit file runs three times, each from scratch in its own run folder: in full (every attack on every cell, no
budget, nothing settled), settled (``attacks: auto``'s settling: a step's attacks stop once its verdict cannot
change) and under a budget (the file's ``budget:``, or ``--budget``: the plan scales down and leaves out attacks).
Every verdict of a cut run must equal the full run's or be inconclusive, and pass the gate at no level where the
full run fails it (``verdict.kinder_than``); the decision of a cut run must not ship where the full run ships nothing.
Each run is added to ``--record`` as it finishes (an interrupted series keeps what it measured and resumes), and
``--table`` writes the comparison into docs/results.md between its markers.

    python benchmarks/budget_vs_full.py [--configs configs/budget_cnn16.yaml ...] [--budget 5m]
    python benchmarks/budget_vs_full.py --table
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from leakaudit.evaluator.audit.budget import parse_duration
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.results.types import StepVerdict
from leakaudit.evaluator.results.verdict import kinder_than
from leakaudit.evaluator.run.runner import run_audit

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["configs/budget_cnn16.yaml", "configs/realistic_cnn16.yaml", "configs/realistic_mlp64.yaml",
           "configs/realistic_clients.yaml"]
RECORD = ROOT / "benchmarks" / "results" / "budget_vs_full.json"
RESULTS = ROOT / "docs" / "results.md"
BEGIN, END = "<!-- budget_vs_full.py: begin -->", "<!-- budget_vs_full.py: end -->"
MODES = ("full", "settled", "budgeted")


def run_mode(config: str, mode: str, budget: float | None, out: Path) -> dict:
    """One run of ``config`` in ``mode``: its wall seconds, its verdicts per (setting, step) and its decision."""
    audit = load_audit(ROOT / config)
    if mode == "budgeted":
        audit.budget = budget or audit.budget
        if audit.budget is None:
            raise SystemExit(f"{config}: no budget: give --budget or a budget: key")
    else:
        audit.budget = None
    if mode == "full":
        audit.attack_choice = ()  # auto's choice stands; only its settling is off
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    summary = run_audit(audit, out, progress=False)
    return {"seconds": round(time.perf_counter() - started, 1), "budget": audit.budget,
            "verdicts": {f"{v.setting} @ {v.checkpoint}": v.to_json() for v in summary.verdicts},
            "decision": None if summary.decision is None else {
                "setting": summary.decision.setting, "binds": summary.decision.binds, "level": summary.decision.level},
            "date": time.strftime("%Y-%m-%d")}


def compare(runs: dict[str, dict]) -> list[str]:
    """The ways a cut run is kinder than the full one (empty: none), verdict by verdict and in its decision."""
    full = {k: StepVerdict.from_json(v) for k, v in runs["full"]["verdicts"].items()}
    problems = []
    for mode in ("settled", "budgeted"):
        if mode not in runs:
            continue
        for key, record in runs[mode]["verdicts"].items():
            cut, whole = StepVerdict.from_json(record), full.get(key)
            if whole is None:
                continue
            if cut.verdict not in (whole.verdict, "inconclusive") or kinder_than(cut, whole):
                problems.append(f"{mode} {key}: {cut.verdict} {cut.level or ''} where the full run says "
                                f"{whole.verdict} {whole.level or ''}")
        decided, whole_decision = runs[mode]["decision"] or {}, runs["full"]["decision"] or {}
        if decided.get("setting") and decided.get("setting") != whole_decision.get("setting"):
            problems.append(f"{mode}: ships {decided['setting']} where the full run ships "
                            f"{whole_decision.get('setting') or 'nothing'}")
    return problems


def said(record: dict) -> str:
    """A verdict as the table prints it: verdict, level and marks."""
    marks = [m for m in ("weak", "borderline", "budget") if record.get(m)]
    return (record["verdict"] or "not judged") + (f" {record['level']}" if record.get("level") not in
                                                    (None, "nothing") else "") + (f" ({', '.join(marks)})" if marks else "")


def table(record: dict) -> str:
    """The markdown table of every compared audit: each verdict in full, settled and budgeted, and the decisions."""
    lines = ["| audit | setting @ step | full | settled | budgeted |", "|---|---|---|---|---|"]
    for config, runs in record.items():
        if "full" not in runs:
            continue
        for key in runs["full"]["verdicts"]:
            cells = [said(runs[m]["verdicts"][key]) if m in runs and key in runs[m]["verdicts"] else "" for m in MODES]
            lines.append(f"| {Path(config).stem} | {key} | " + " | ".join(cells) + " |")
        decisions = [runs[m]["decision"] for m in MODES if m in runs]
        lines.append(f"| {Path(config).stem} | decision | " + " | ".join(
            "ship " + d["setting"] if d and d["setting"] else f"none ({d['binds']} binds)" if d else ""
            for d in decisions) + " |")
        seconds = [f"{runs[m]['seconds']:.0f} s" for m in MODES if m in runs]
        lines.append(f"| {Path(config).stem} | wall time | " + " | ".join(seconds) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--budget", help="the budgeted runs' budget (default: each file's budget: key)")
    parser.add_argument("--record", type=Path, default=RECORD)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "budget_vs_full")
    parser.add_argument("--table", action="store_true", help="write the record's table into docs/results.md")
    args = parser.parse_args()
    record = json.loads(args.record.read_text()) if args.record.exists() else {}
    if args.table:
        text = RESULTS.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        RESULTS.write_text(text[:start] + "\n" + table(record) + "\n" + text[end:])
        return 0
    budget = parse_duration(args.budget) if args.budget else None
    failed = False
    for config in args.configs:
        runs = record.setdefault(config, {})
        for mode in MODES:
            if mode not in runs:
                runs[mode] = run_mode(config, mode, budget, args.out / Path(config).stem / mode)
                args.record.parent.mkdir(parents=True, exist_ok=True)
                args.record.write_text(json.dumps(record, indent=1))
            print(f"{config} {mode}: {runs[mode]['seconds']} s", flush=True)
        problems = compare(runs)
        failed |= bool(problems)
        print(f"{config}: " + ("never kinder than the full run" if not problems else "; ".join(problems)))
    print(table(record))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
