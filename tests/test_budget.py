"""Time before work and ``budget:``: the duration's one-line errors, the plan that fits an audit into its budget
(checked on the estimate, never by timing a test), and a budgeted run whose report names what it cut."""
from __future__ import annotations

import dataclasses
import json

import pytest

from leakaudit.evaluator.audit.budget import budget_lines, duration_text, parse_duration
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.run import estimate as est
from leakaudit.evaluator.run.estimate import Cost, fit_budget, predict

FORM = "expected a duration like 90s, 10m or 1h"


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("10m", 600), ("1h", 3600), ("1.5h", 5400), (600, 600),
                                          ("45", 45), ("2 m", 120)])
def test_durations_read_as_written(text, seconds):
    assert parse_duration(text) == seconds


def test_durations_print_as_waits():
    assert [duration_text(s) for s in (40, 200, 3900)] == ["40 s", "3 min 20 s", "1 h 05 min"]


@pytest.mark.parametrize("value", ["ten", "10 minutes", 0, -5, True, "1d", [10]])
def test_a_bad_budget_is_one_line_naming_the_form(write_audit, value):
    from conftest import small_audit

    path = write_audit({**small_audit(), "budget": value})
    with pytest.raises(ConfigError) as exc:
        load_audit(path)
    assert len(exc.value.lines) == 1
    line = exc.value.lines[0]
    assert line.startswith(f"{path}: budget: ")
    assert FORM in line or "is not of type str or int or float" in line


def test_run_budget_flag_is_checked_before_work(write_audit, capsys):
    from conftest import small_audit
    from leakaudit.evaluator.cli import main

    assert main(["run", str(write_audit(small_audit())), "--out", "unused", "--budget", "soon"]) == 2
    assert capsys.readouterr().err == f"leakaudit: error: --budget: {FORM}, got 'soon'\n"


class FakeCalibration:
    """Costs as measured: each attack's per-iteration cost per setting, a fixed cost, and training."""

    def __init__(self, per_iteration: dict[str, float]):
        self.per_iteration = per_iteration

    def attack(self, setting, spec):
        return Cost(1.0, {"iterations": self.per_iteration[spec.name]}, problems=2)

    def training(self, setting):
        return Cost(2.0, {"steps": 0.01})

    def start(self):
        return 3.0


def _auto_audit(write_audit, budget):
    from conftest import small_audit

    audit = small_audit(attacks="auto", budget=budget, model={"name": "cnn_bayes", "checkpoints": [0, 5]},
                        data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 2})
    return load_audit(write_audit(audit))


def test_the_plan_keeps_cheap_attacks_whole_scales_the_next_and_leaves_out_the_rest(write_audit):
    audit = _auto_audit(write_audit, "3m")
    names = sorted(a.name for a in audit.attacks)
    assert names == ["bayes", "cinet", "inverting_gradients", "learning_to_invert"]
    cal = FakeCalibration({"inverting_gradients": 0.005, "bayes": 0.01, "cinet": 0.05, "learning_to_invert": 1.0})
    full = predict(audit, cal, 1)
    # one worker: training 2 settings x (2 + 0.01 x 5) s, then each attack's cells on 2 settings x 2 steps
    assert full.training == {"none": 2.05, "gaussian(sigma=0.1)": 2.05}
    assert full.cells[("none", "inverting_gradients", 0)] == pytest.approx(1 + 0.005 * 1000)
    assert full.cells[("gaussian(sigma=0.1)", "learning_to_invert", 5)] == pytest.approx(1 + 1.0 * 1500)
    plan = fit_budget(audit, cal, 1)
    assert plan["order"] == ["inverting_gradients", "bayes", "cinet", "learning_to_invert"]
    # start 3 s, training 4.1 s, report 6 s, inverting_gradients 4 x 6 s, bayes 4 x 11 s: 98.9 s left for cinet's
    # 4 x (1 + 0.05 u)
    assert plan["params"] == {"cinet": {"iterations": 474}}
    assert plan["dropped"] == {"learning_to_invert": "left out: it needs about 12 min 32 s even at 1/8 of its "
                                                     "updates and iterations"}  # 4 x (1 + 187)
    est.apply_plan(audit, plan)
    after = predict(audit, cal, 1)
    assert after.total <= 180 < full.total
    assert sorted(a.name for a in audit.attacks) == ["bayes", "cinet", "inverting_gradients"]
    lines = budget_lines(plan)
    assert lines[0] == f"budget 3 min 00 s: the audit in full would take about {duration_text(full.total)}"
    assert lines[1:] == ["  cut: cinet: iterations 1000 -> 474",
                         "  cut: learning_to_invert: left out: it needs about 12 min 32 s even at 1/8 of its updates "
                         "and iterations"]


def test_a_budget_below_the_training_is_one_line(write_audit):
    audit = _auto_audit(write_audit, "5s")
    cal = FakeCalibration({"inverting_gradients": 0.005, "bayes": 0.01, "cinet": 0.05, "learning_to_invert": 1.0})
    with pytest.raises(ConfigError) as exc:
        fit_budget(audit, cal, 1)
    assert exc.value.lines == [f"{audit.path}: budget: 5 s is less than the training and the cheapest attack "
                               "(inverting_gradients) need here, about 20 s; give at least 1m"]


@pytest.mark.slow
def test_a_tight_budget_fits_the_estimate_and_the_report_names_the_cut(write_audit, tmp_path, monkeypatch, capsys):
    """A realistic-shaped audit (a defense beside its reference, two steps, a cheap exact attack and two that
    optimise) under half its estimated time: the plan's estimate fits, the exact attack settles both settings at
    both steps so the others are skipped, and the terminal and report say what was cut."""
    from conftest import small_audit
    from leakaudit.evaluator.cli import main
    from leakaudit.evaluator.run.estimate import estimate_audit, plan_and_estimate

    monkeypatch.setenv("LEAKAUDIT_ESTIMATE", "1")
    spec = small_audit(model={"name": "mlp", "checkpoints": [0, 5]},
                       data={"dataset": "digits", "image_size": 8, "targets": 2, "batch_size": 1},
                       defenses=[{"name": "none"}, {"name": "clip", "params": {"max_norm": 1.0}}],
                       attacks=[{"name": "analytic"}, {"name": "inverting_gradients", "params": {"iterations": 400}},
                                {"name": "bayes", "params": {"iterations": 400}}], metrics=["psnr", "label_accuracy"])
    full, _ = estimate_audit(load_audit(write_audit(spec)))
    budget = round(full.total * 0.6)
    audit = load_audit(write_audit({**spec, "budget": budget}))
    assert plan_and_estimate(audit).total <= budget < full.total  # what the run will do fits, on the estimate
    assert audit.budget_plan["order"][0] == "analytic" and audit.budget_plan["cut"]
    assert main(["run", str(write_audit(spec)), "--out", str(tmp_path / "run"), "--budget", f"{budget}s",
                 "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "estimated time on this machine: at most about" in out.err
    plan = json.loads((tmp_path / "run" / "run.json").read_text())["budget"]
    assert plan["seconds"] == budget and plan["cut"]
    assert {tuple(s[:3]) for s in plan["skipped"]} == {(s, a, c) for s in ("none", "clip(max_norm=1.0)")
                                                       for a in plan["order"][1:] if a not in plan["dropped"]
                                                       for c in (0, 5)}
    assert f"budget {duration_text(budget)}: the audit in full would take about" in out.out
    said = next(line for line in out.out.splitlines() if line.startswith("  skipped where the step's verdict"))
    assert all(f"{attack} on clip(max_norm=1.0) (step 0, 5), none (step 0, 5)" in said  # the defense's run first
               for attack in plan["order"][1:] if attack not in plan["dropped"])
    report = (tmp_path / "run" / "report.html").read_text()
    assert "<dt>Budget</dt>" in report and plan["cut"][0].split(": ")[0] in report


def test_the_progress_bars_count_down_the_whole_audit():
    """Each phase's bar names the audit's time left: the phases still ahead, or the estimate less the time spent
    where that is more."""
    import time

    from leakaudit.evaluator.run.estimate import Estimate
    from leakaudit.evaluator.run.runner import Countdown

    wall = {"start": 5.0, "training": 60.0, "tuning": 0.0, "attacks": 120.0, "report": 6.0}
    estimate = Estimate(2, {}, {}, {}, wall)
    assert Countdown(estimate, time.perf_counter()).left("training") == " (audit: about 3 min 11 s left)"
    assert Countdown(estimate, time.perf_counter() - 100).left("attacks") == " (audit: about 2 min 06 s left)"
    assert Countdown(None, time.perf_counter()).left("attacks") == ""


def test_auto_settles_a_step_and_skips_a_reference_only_where_nothing_it_vouches_for_can_change(write_audit, tmp_path):
    """Under attacks: auto a step's attacks stop once its verdict is settled: the exact attack breaks both the
    undefended update and near-zero noise at the level of individuals, so neither runs Inverting Gradients after
    it; run.json, the report and a rebuilt report say so. A reference's attack is kept while a setting it
    calibrates could still read "protects", unless that attack cannot vouch for it (an exact attack on noise)."""
    from conftest import small_audit
    from leakaudit.evaluator.audit.jobs import jobs_of
    from leakaudit.evaluator.run.runner import (RunError, Settling, _is_settled, rebuild_report, report_folder,
                                                run_audit, settling_for)
    from leakaudit.evaluator.results.rundir import RunFolder

    spec = small_audit(model={"name": "mlp", "checkpoints": [0]},
                       data={"dataset": "digits", "image_size": 8, "targets": 2, "batch_size": 1},
                       defenses=[{"name": "none"}, {"name": "gaussian", "params": {"sigma": 1e-6}}],
                       attacks=[{"name": "analytic"}, {"name": "inverting_gradients", "params": {"iterations": 20}}],
                       metrics=["psnr", "label_accuracy"])
    audit = load_audit(write_audit(spec))
    assert settling_for(audit, RunFolder(tmp_path / "x", audit), False, None) is None  # listed attacks all run
    audit.attack_choice = tuple(f"{a.label}: chosen" for a in audit.attacks)  # as attacks: auto marks its choice
    by_bound = dataclasses.replace(audit, verdict=dataclasses.replace(audit.verdict, statistic="ci_bound"))
    assert settling_for(by_bound, RunFolder(tmp_path / "x", by_bound), False, None) is None  # an interval's end
    summary = run_audit(audit, tmp_path / "run", progress=False)
    settled = json.loads((tmp_path / "run" / "run.json").read_text())["settled"]
    assert settled["order"] == ["analytic", "inverting_gradients"]  # no estimate in tests: the audit's order
    assert sorted(tuple(s[:3]) for s in settled["skipped"]) == [("gaussian(sigma=1e-06)", "inverting_gradients", 0),
                                                                ("none", "inverting_gradients", 0)]
    assert {(v.setting, v.verdict, v.level) for v in summary.verdicts} == {
        ("none", "leaks", "individuals"), ("gaussian(sigma=1e-06)", "leaks", "individuals")}
    assert "<dt>Settled</dt>" in (tmp_path / "run" / "report.html").read_text()
    assert {(v.setting, v.verdict) for v in rebuild_report(RunFolder(tmp_path / "run", audit)).verdicts} == {
        (v.setting, v.verdict) for v in summary.verdicts}
    # a verdict: section other than the one it ran under may need the skipped rows: refused in one line
    other = write_audit({**spec, "verdict": {"margin": 3.0}}, "other.yaml")
    with pytest.raises(RunError, match=r"other\.yaml: verdict:, leakage_metric: the run at .* skipped attacks"):
        report_folder(tmp_path / "run", str(other))
    # a cell begun before a resume is finished, and only whole cells settle a step: without one of its rows the
    # exact attack's cell on the reference neither settles it nor is cut short
    folder = RunFolder(tmp_path / "run", audit)
    kept = [r for r in folder.rows() if (r.setting, r.attack, r.target) != ("none", "analytic", 1)]
    folder.results.path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in kept))
    settling = Settling(settled, audit, folder, json.loads((tmp_path / "run" / "baselines.json").read_text()))
    pending = [j for j in jobs_of(audit) if j.setting.key == "none" and (j.attack.name, j.target) != ("analytic", 0)]
    assert settling.unsettled(pending) == pending
    # the rule itself: the reference's job waits for the setting it calibrates, except an exact attack's on noise
    none, noisy = audit.settings
    ig, exact = (next(j for j in jobs_of(audit) if j.setting is none and j.attack.name == n)
                 for n in ("inverting_gradients", "analytic"))
    leaks = {("none", 0)}
    assert not _is_settled(audit, ig, leaks, set())
    assert _is_settled(audit, ig, leaks, {(noisy.key, 0)})
    assert _is_settled(audit, exact, leaks, set()) == audit.registry.get("attack", "analytic").noise_free_only


def test_an_attacks_cached_cost_is_keyed_by_its_code():
    """A cost measured before an attack's file changed is not read back: its key holds the file's digest."""
    import hashlib
    import inspect

    from leakaudit.attacks.cinet import CINet
    from leakaudit.attacks.learned import LearningToInvert

    digest = est.code_of(LearningToInvert)
    assert digest == hashlib.sha256(open(inspect.getsourcefile(LearningToInvert), "rb").read()).hexdigest()[:16]
    assert digest != est.code_of(CINet) and est.code_of(int) == ""
