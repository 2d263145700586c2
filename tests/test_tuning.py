"""The adaptive attacker: a seeded, budgeted search that never does worse than the untuned attack."""
from __future__ import annotations

import json

import pytest

from leakaudit.evaluator import runner
from leakaudit.evaluator.config import ConfigError, load_audit
from leakaudit.evaluator.runner import run_audit
from leakaudit.evaluator.tuning import TuneSpec, candidates, grid_positions, value_at, with_value

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
    from leakaudit.evaluator.report import summarise_tuning

    audit = load_audit(write_audit(small_audit(attacks=[{**TUNED, "tune": {"budget": 3, "space": {
        "lr": [0.03, 0.1, 0.3]}}}])))
    row = {"setting": "none", "attack": "bayes", "checkpoint": 0, "metric": "psnr", "seconds": 1.0}
    base = {"iterations": 40, "lr": 0.001}
    trials = [{**row, "trial": 0, "params": base, "score": 10.0},
              {**row, "trial": 1, "params": {**base, "lr": 0.1}, "score": 12.0},
              {**row, "trial": 2, "params": {**base, "lr": 0.3}, "score": 14.0}]
    notes: list[str] = []
    (line,) = summarise_tuning(audit, trials, notes)
    assert line["winner"] == {"lr": 0.3} and line["on_grid"] == "lr: highest" and line["budget"] == 3
    assert notes == ["none, bayes, step 0: the tuned lr=0.3 is the highest value of its grid [0.03, 0.1, 0.3]; "
                     "the best may lie beyond it: widen the grid"]
    trials[2]["score"] = 11.0  # the winner inside the grid: no warning
    notes.clear()
    assert summarise_tuning(audit, trials, notes)[0]["on_grid"] == "lr: inside" and notes == []


def test_candidates_start_untuned_are_distinct_and_seeded():
    spec = TuneSpec(space={"lr": [0.01, 0.1, 1.0], "warmup": [0, 10]}, budget=5)
    defaults = {"lr": 0.1, "warmup": 0, "iterations": 100}
    trials = candidates(spec, {"iterations": 50}, defaults, seed=7)
    assert trials[0] == {"lr": 0.1, "warmup": 0, "iterations": 50}
    assert len(trials) == 5 and all(t not in trials[:i] for i, t in enumerate(trials))
    assert trials == candidates(spec, {"iterations": 50}, defaults, seed=7)
    assert len(candidates(TuneSpec(space={"lr": [0.1, 0.5]}, budget=10), {}, defaults, 0)) == 2  # grid exhausted


@pytest.mark.parametrize("tune, expected", [
    ({"budget": 3}, "attacks[0].tune.space: required parameter is missing"),
    ({"space": {"step": [1]}}, "attacks[0].tune.space.step: not a parameter of 'bayes'; choices: iterations, "),
    ({"space": {"lr": [0.1, -1.0]}}, "attacks[0].tune.space.lr[1]: bayes.lr: -1.0 must be greater than 0.0"),
    ({"space": {"priors.tvv": [1.0]}}, "attacks[0].tune.space.priors.tvv[0]: unknown prior 'tvv'"),
    ({"space": {"lr": [0.1]}, "metric": "label_accuracy"},
     "attacks[0].tune.metric: 'label_accuracy' does not score images; choose an image metric"),
    ({"space": {"lr": [0.1]}, "budget": 0}, "attacks[0].tune.budget: 0 is below the minimum 1"),
])
def test_bad_tune_sections_are_one_line_each(write_audit, tune, expected):
    path = write_audit(small_audit(attacks=[{"name": "bayes", "tune": tune}]))
    with pytest.raises(ConfigError) as info:
        load_audit(path)
    (line,) = info.value.lines
    assert line.startswith(f"{path}: {expected}"), line


def test_tuned_audit_reports_the_search_and_attacks_with_the_winner(write_audit, tmp_path, monkeypatch):
    audit = load_audit(write_audit(small_audit(attacks=[TUNED], defenses=[{"name": "gaussian",
                                                                           "params": {"sigma": 0.01}}],
                                               utility={"train_steps": 0})))
    out = tmp_path / "out"
    summary = run_audit(audit, out, progress=False)
    trials = [json.loads(line) for line in (out / "tuning.jsonl").read_text().splitlines()]
    assert [t["trial"] for t in trials] == [0, 1, 2] and trials[0]["params"]["lr"] == 0.001
    (search,) = summary["tuning"]
    assert search["budget"] == 3 and search["trials"] == 3
    assert search["tuned"] >= search["untuned"]
    assert search["tuned"] == max(t["score"] for t in trials)
    best = max(trials, key=lambda t: t["score"])["params"]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all(r["attack_params"] == best for r in rows)
    assert "hyperparameter search" in (out / "report.html").read_text()
    # a resumed run redoes no trial
    calls = []
    monkeypatch.setattr(runner.AuditWorker, "tune", lambda self, cell: calls.extend(cell.jobs) or [])
    run_audit(audit, out, resume=True, progress=False)
    assert calls == []
