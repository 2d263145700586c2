"""The pretrained CNN at batch 64 (configs/realistic_cnn64.yaml): its verdict per threat model and step, with the
attack that decided, measured by one ``leakaudit run`` and written as a table into docs/results.md.

The file's full budget is a GPU's; ``--budget`` runs it within a wall time (attacks cheapest first, the others
scaled down or left out, the verdicts they would have decided left open), as on this CPU. The run folder keeps
what it measured: a rerun with ``--resume`` continues it. ``--table`` rewrites the table from the run's
summary.json without running.

    python benchmarks/realistic_cnn64.py --budget 1h [--resume]
    python benchmarks/realistic_cnn64.py --table
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from realistic_audits import machine  # noqa: E402  (a sibling script, not a package)

CONFIG = "configs/realistic_cnn64.yaml"
RECORD = ROOT / "benchmarks" / "results" / "realistic_cnn64.json"
RESULTS = ROOT / "docs" / "results.md"
BEGIN, END = "<!-- realistic_cnn64.py: begin -->", "<!-- realistic_cnn64.py: end -->"


def run(out: Path, budget: str | None, resume: bool) -> float:
    """``leakaudit run`` of the file in its own process: its wall seconds."""
    command = [str(Path(sys.executable).with_name("leakaudit")), "run", CONFIG, "--out", str(out), "--no-progress"]
    command += (["--budget", budget] if budget else []) + (["--resume"] if resume else [])
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{CONFIG}: leakaudit run exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return time.perf_counter() - started


def rows(summary: dict) -> list[dict]:
    """One row per setting, step and threat model (the whole verdict where one attacker ran every attack), with the
    deciding attack's originals named among decoys and the step's test accuracy; a setting that no attack ran on (a
    budget left them all out) gets a row per step that says so."""
    cells = {(c["setting"], c["checkpoint"], c["attack"]): c for c in summary["cells"]}
    out = []
    for w in summary["worst_case"]:
        setting = w["setting"]
        verdicts = [v for v in summary["verdicts"] if v["setting"] == setting]
        for v in verdicts:
            for t in v.get("by_threat") or [{"threat": "every attacker", **v, "attacks": None}]:
                cell = cells.get((setting, v["checkpoint"], t.get("attack"))) or {}
                out.append({"setting": setting, "step": v["checkpoint"], "threat": t["threat"],
                            "verdict": t["verdict"], "level": t.get("level"), "attack": t.get("attack"),
                            "attacks": t.get("attacks"), "named": cell.get("decoy_hits"),
                            "of": cell.get("identifiable_n")})
        if not verdicts:
            out += [{"setting": setting, "step": step, "threat": "every attacker", "verdict": "not judged",
                     "level": None, "attack": None, "attacks": [], "named": None, "of": None}
                    for step in summary["checkpoints"]]
    for r in out:
        r["accuracy"] = ((summary["utility"].get(r["setting"]) or {}).get("checkpoint_accuracy") or {}).get(str(r["step"]))
    return out


def table(record: dict) -> str:
    """The record as markdown: the run's conditions, then a row per setting, step and threat model."""
    lines = [f"Measured by `benchmarks/realistic_cnn64.py` on {record['machine']}, {record['date']}: "
             f"`leakaudit run {CONFIG}` under `--budget {record['budget']}` in {record['seconds'] / 60:.0f} min.", "",
             "| setting | step | test accuracy | threat model | verdict | decided by | named among decoys | "
             "attacks judged |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in record["rows"]:
        level = f" {r['level']}" if r["verdict"] == "leaks" and r["level"] else ""
        judged = ", ".join(r["attacks"]) if r["attacks"] else "all that ran" if r["attacks"] is None else "none ran"
        named = f"{r['named']} of {r['of']}" if r.get("named") is not None else "-"
        accuracy = f"{r['accuracy']:.2f}" if r.get("accuracy") is not None else "-"
        lines.append(f"| {r['setting']} | {r['step']} | {accuracy} | {r['threat']} | {r['verdict']}{level} | "
                     f"{r['attack'] or '-'} | {named} | {judged} |")
    return "\n".join(lines)


def write_table(record: dict) -> None:
    """Put the table between the markers of docs/results.md."""
    text = RESULTS.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{RESULTS}: no {BEGIN} ... {END} markers to write the table between")
    head, rest = text.split(BEGIN, 1)
    RESULTS.write_text(f"{head}{BEGIN}\n{table(record)}\n{END}{rest.split(END, 1)[1]}")
    print(table(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default=None, help="the run's wall time (leakaudit run --budget); none: full")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    parser.add_argument("--out", default=str(ROOT / "runs" / "realistic_cnn64"))
    parser.add_argument("--table", action="store_true", help="rewrite the table from the record, running nothing")
    args = parser.parse_args()
    if not args.table:
        seconds = run(Path(args.out), args.budget, args.resume)
        summary = json.loads((Path(args.out) / "summary.json").read_text())
        record = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "budget": args.budget or "none",
                  "seconds": round(seconds, 1), "rows": rows(summary)}
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
    write_table(json.loads(RECORD.read_text()))


if __name__ == "__main__":
    main()
