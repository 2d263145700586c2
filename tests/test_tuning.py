"""The adaptive attacker: a seeded, budgeted search that never does worse than the untuned attack."""
from __future__ import annotations

import json

import pytest

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.tuning import (
    ScanSpec,
    TuneSpec,
    candidates,
    grid_positions,
    scan_best,
    value_at,
    with_value,
)
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.run import worker
from leakaudit.evaluator.run.runner import run_audit

from conftest import small_audit

TUNED = {"name": "bayes", "params": {"iterations": 40, "lr": 0.001},
         "tune": {"budget": 3, "space": {"lr": [0.03, 0.1], "priors.tv": [0.0001, 0.01]}}}


def test_dotted_keys_reach_into_mappings_without_touching_the_original():
    base = {"lr": 0.1, "priors": {"tv": 0.01, "l2": 0.5}}
    assert with_value(base, "priors.tv", 0.2) == {"lr": 0.1, "priors": {"tv": 0.2, "l2": 0.5}}
    assert with_value(base, "lr", 1.0)["lr"] == 1.0 and base["priors"]["tv"] == 0.01


def test_where_a_winner_sits_on_its_grid():
    space = {"lr": [0.05, 0.5, 0.25], "priors.tv": [1e-4, 1e-2], "label_method": ["signs", "feature_fit"]}
    params = {"lr": 0.5, "priors": {"tv": 1e-4}, "label_method": "signs"}
    assert value_at(params, "priors.tv") == 1e-4 and value_at(params, "priors.l2") is None
    assert grid_positions(space, params) == {"lr": "highest", "priors.tv": "lowest", "label_method": "one of"}
    assert grid_positions(space, {**params, "lr": 0.25})["lr"] == "inside"
    assert grid_positions(space, {**params, "lr": 0.1})["lr"] == "off the grid"


def test_a_winner_on_a_grid_edge_is_a_warning(write_audit):
    from leakaudit.evaluator.results.summary import summarise_tuning

    audit = load_audit(write_audit(small_audit(attacks=[{**TUNED, "tune": {"budget": 3, "space": {
        "lr": [0.03, 0.1, 0.3]}}}])))
    row = {"setting": "none", "attack": "bayes", "checkpoint": 0, "metric": "psnr", "seconds": 1.0}
    base = {"iterations": 40, "lr": 0.001}
    trials = [{**row, "trial": 0, "params": base, "score": 10.0},
              {**row, "trial": 1, "params": {**base, "lr": 0.1}, "score": 12.0},
              {**row, "trial": 2, "params": {**base, "lr": 0.3}, "score": 14.0}]
    notes: list[str] = []
    (line,) = summarise_tuning(audit, trials, notes)
    assert line.winner == {"lr": 0.3} and line.on_grid == "lr: highest" and line.budget == 3
    assert notes == ["none, bayes, step 0: the tuned lr=0.3 is the highest value of its grid [0.03, 0.1, 0.3]; "
                     "the best may lie beyond it: widen the grid"]
    trials[2]["score"] = 11.0  # the winner inside the grid: no warning
    notes.clear()
    assert summarise_tuning(audit, trials, notes)[0].on_grid == "lr: inside" and notes == []


def test_candidates_start_untuned_are_distinct_and_seeded():
    spec = TuneSpec(space={"lr": [0.01, 0.1, 1.0], "warmup": [0, 10]}, budget=5)
    defaults = {"lr": 0.1, "warmup": 0, "iterations": 100}
    trials = candidates(spec, {"iterations": 50}, defaults, seed=7)
    assert trials[0] == {"lr": 0.1, "warmup": 0, "iterations": 50}
    assert len(trials) == 5 and all(t not in trials[:i] for i, t in enumerate(trials))
    assert trials == candidates(spec, {"iterations": 50}, defaults, seed=7)
    assert len(candidates(TuneSpec(space={"lr": [0.1, 0.5]}, budget=10), {}, defaults, 0)) == 2  # grid exhausted


def test_a_scan_is_log_spaced_and_its_refinement_spans_half_to_twice_the_best():
    scan = ScanSpec(param="priors.tv", low=1e-7, high=1e5)
    assert scan.values() == [10.0 ** e for e in range(-7, 6)]
    assert ScanSpec(param="lr", low=0.01, high=1.0, per_decade=2).values() == [0.01, 0.0316, 0.1, 0.316, 1.0]
    assert scan.around(100.0) == [50.0, 70.7, 100.0, 141.0, 200.0]
    assert ScanSpec(param="lr", low=1, high=10, refine=3, factor=4.0).around(1.0) == [0.25, 1.0, 4.0]


def test_a_scanning_search_scans_first_then_grids_around_the_scan_best():
    spec = TuneSpec(space={"lr": [0.1, 0.5]}, budget=20, scan=ScanSpec(param="priors.tv", low=1e-2, high=1e2))
    base, defaults = {"iterations": 50, "priors": {"tv": 0.5}}, {"lr": 0.1}
    scan = candidates(spec, base, defaults, seed=3)
    assert [value_at(t, "priors.tv") for t in scan] == [0.5, 0.01, 0.1, 1.0, 10.0, 100.0]
    assert all(t["lr"] == 0.1 for t in scan)  # the rest untuned while scanning
    rows = [{"setting": "s", "attack": "a", "checkpoint": 0, "trial": i, "params": p, "metric": "psnr",
             "score": -abs(value_at(p, "priors.tv") - 10.0)} for i, p in enumerate(scan)]

    class Psnr:
        higher_is_better = True
    registry = type("Registry", (), {"get": staticmethod(lambda kind, name: Psnr)})
    assert scan_best(spec, rows[:-1], len(scan), registry) is None  # the scan is not finished
    best = scan_best(spec, rows, len(scan), registry)
    assert best == 10.0
    trials = candidates(spec, base, defaults, seed=3, best=best)
    # the grid: 2 lr x 5 values of tv, less lr 0.1 with tv 10 (already tried in the scan)
    assert trials[:len(scan)] == scan and len(trials) == 6 + 2 * 5 - 1
    assert {value_at(t, "priors.tv") for t in trials[len(scan):]} == {5.0, 7.07, 10.0, 14.1, 20.0}
    assert trials == candidates(spec, base, defaults, seed=3, best=best)


def test_a_scan_best_on_its_edge_is_a_warning(write_audit):
    from leakaudit.evaluator.results.summary import summarise_tuning

    tune = {"budget": 8, "space": {"lr": [0.03, 0.1]},
            "scan": {"param": "priors.tv", "low": 1e-4, "high": 1e-2, "refine": 3}}
    audit = load_audit(write_audit(small_audit(attacks=[{**TUNED, "tune": tune}])))
    row = {"setting": "none", "attack": "bayes", "checkpoint": 0, "metric": "psnr", "seconds": 1.0}
    base = {"iterations": 40, "lr": 0.001, "priors": {"tv": 0.001}}
    scores = {0.001: 10.0, 1e-4: 9.0, 0.01: 12.0}
    trials = [{**row, "trial": i, "stage": "scan", "params": with_value(base, "priors.tv", tv), "score": scores[tv]}
              for i, tv in enumerate([0.001, 1e-4, 0.01])]
    trials.append({**row, "trial": 3, "stage": "grid", "params": {**with_value(base, "priors.tv", 0.01), "lr": 0.1},
                   "score": 13.0})
    notes: list[str] = []
    (line,) = summarise_tuning(audit, trials, notes)
    assert line.on_grid == "scan priors.tv: 0.01 (highest); lr: highest; priors.tv: inside"
    assert notes[-1] == ("none, bayes, step 0: the scan's best priors.tv=0.01 is the highest value of its scan "
                         "0.0001..0.01; the best may lie beyond it: widen the scan")


@pytest.mark.slow
def test_a_scanning_audit_runs_its_grid_around_the_scan_best_and_resumes(write_audit, tmp_path):
    tune = {"budget": 7, "space": {"lr": [0.03, 0.1]},
            "scan": {"param": "priors.tv", "low": 1e-4, "high": 1e-2, "refine": 2}}
    audit = load_audit(write_audit(small_audit(
        attacks=[{**TUNED, "params": {"iterations": 30, "lr": 0.05, "priors": {"tv": 0.05}}, "tune": tune}],
        defenses=[{"name": "gaussian", "params": {"sigma": 0.01}}], utility={"train_steps": 0})))
    out = tmp_path / "out"
    summary = run_audit(audit, out, progress=False)
    trials = [t for line in (out / "tuning.jsonl").read_text().splitlines()
              if (t := json.loads(line))["setting"] != "none"]  # the added reference is tuned alike
    assert [t["stage"] for t in trials] == ["scan"] * 4 + ["grid"] * 3 and len(summary.tuning) == 2
    best = max(trials[:4], key=lambda t: t["score"])["params"]["priors"]["tv"]
    grid = {t["params"]["priors"]["tv"] for t in trials[4:]}
    assert grid <= {float(f"{best / 2:.3g}"), float(f"{best * 2:.3g}")}
    assert all(t["params"]["lr"] in (0.03, 0.1) for t in trials[4:])
    (out / "tuning.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trials[:5]))  # stopped in the grid
    run_audit(audit, out, resume=True, progress=False)
    again = [t for line in (out / "tuning.jsonl").read_text().splitlines()
             if (t := json.loads(line))["setting"] != "none"]
    assert [t["trial"] for t in again] == list(range(7))
    assert [t["params"] for t in again[5:]] == [t["params"] for t in trials[5:]]
    assert [t["score"] for t in again[5:]] == pytest.approx([t["score"] for t in trials[5:]], abs=1e-3)


@pytest.mark.parametrize("tune, expected", [
    ({"budget": 3}, "attacks[0].tune.space: required parameter is missing"),
    ({"space": {"step": [1]}}, "attacks[0].tune.space.step: not a parameter of 'bayes'; choices: iterations, "),
    ({"space": {"lr": [0.1, -1.0]}}, "attacks[0].tune.space.lr[1]: bayes.lr: -1.0 must be greater than 0.0"),
    ({"space": {"priors.tvv": [1.0]}}, "attacks[0].tune.space.priors.tvv[0]: unknown prior 'tvv'"),
    ({"space": {"lr": [0.1]}, "metric": "label_accuracy"},
     "attacks[0].tune.metric: 'label_accuracy' does not score images; choose an image metric"),
    ({"space": {"lr": [0.1]}, "budget": 0}, "attacks[0].tune.budget: 0 is below the minimum 1"),
    ({"space": {}, "budget": 20, "scan": {"param": "priors.tvv", "low": 1e-3, "high": 1.0}},
     "attacks[0].tune.scan.low: unknown prior 'tvv'"),
    ({"space": {}, "budget": 20, "scan": {"param": "step", "low": 1e-3, "high": 1.0}},
     "attacks[0].tune.scan.param: 'step' is not a parameter of 'bayes'; choices: iterations, "),
    ({"space": {"priors.tv": [1.0]}, "budget": 20, "scan": {"param": "priors.tv", "low": 1e-3, "high": 1.0}},
     "attacks[0].tune.scan.param: 'priors.tv' is also in tune.space; the scan sets its grid (remove it from space)"),
    ({"space": {}, "budget": 20, "scan": {"param": "priors.tv", "low": 1.0, "high": 1e-3}},
     "attacks[0].tune.scan.high: 0.001 must be greater than low (1.0)"),
    ({"space": {}, "budget": 5, "scan": {"param": "priors.tv", "low": 1e-7, "high": 1e5}},
     "attacks[0].tune.scan: 13 scan values and the untuned setting leave no grid trial in tune.budget 5; raise "
     "the budget to at least 15 or scan fewer values"),
    ({"space": {}, "scan": {"param": "priors.tv", "low": 0.0, "high": 1.0}},
     "attacks[0].tune.scan.low: 0.0 must be greater than 0.0"),
    ({"space": {}, "scan": {"param": "priors.tv", "low": 1e-3, "high": 1.0, "refine": 3, "factr": 2}},
     "attacks[0].tune.scan.factr: unknown parameter (did you mean 'factor'?); choices: factor, high, low, "),
])
def test_bad_tune_sections_are_one_line_each(write_audit, tune, expected):
    path = write_audit(small_audit(attacks=[{"name": "bayes", "tune": tune}]))
    with pytest.raises(ConfigError) as info:
        load_audit(path)
    (line,) = info.value.lines
    assert line.startswith(f"{path}: {expected}"), line


@pytest.mark.slow
def test_tuned_audit_reports_the_search_and_attacks_with_the_winner(write_audit, tmp_path, monkeypatch):
    audit = load_audit(write_audit(small_audit(attacks=[TUNED], defenses=[{"name": "gaussian",
                                                                           "params": {"sigma": 0.01}}],
                                               utility={"train_steps": 0})))
    out = tmp_path / "out"
    summary = run_audit(audit, out, progress=False)
    trials = [t for line in (out / "tuning.jsonl").read_text().splitlines()
              if (t := json.loads(line))["setting"] != "none"]  # the added reference is tuned alike
    assert [t["trial"] for t in trials] == [0, 1, 2] and trials[0]["params"]["lr"] == 0.001
    (search,) = [s for s in summary.tuning if s.setting != "none"]
    assert search.budget == 3 and search.trials == 3
    assert search.tuned >= search.untuned
    assert search.tuned == max(t["score"] for t in trials)
    best = max(trials, key=lambda t: t["score"])["params"]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all(r["attack_params"] == best for r in rows)
    assert "hyperparameter search" in (out / "report.html").read_text()
    # a resumed run redoes no trial
    calls = []
    monkeypatch.setattr(worker.AuditWorker, "tune", lambda self, cell: calls.extend(cell.jobs) or [])
    run_audit(audit, out, resume=True, progress=False)
    assert calls == []
