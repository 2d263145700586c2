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


def test_a_heavy_cell_stops_the_probe_where_noise_hides_a_unit():
    """A cell of 100 s whose iterations cost nothing above its noise: each budget parameter is raised once (4x its
    least value: 16 updates, 1 iteration), not fourfold again and again up to its full value (hours of cells for
    learning_to_invert)."""
    from types import SimpleNamespace

    from leakaudit.evaluator.audit.types import AttackSpec
    from leakaudit.plugins.manager import load_registry

    timed = []

    def time_cell(_setting, _spec, units):  # 100 s a cell, 1 s a simulated update, iterations free; noise -0.5 s
        timed.append(dict(units))
        return 100.0 + units["updates"] - 0.5 * (len(timed) > 1)

    cal = object.__new__(est.Calibration)
    cal.scenario = SimpleNamespace(audit=SimpleNamespace(registry=load_registry()))
    cal._time_cell = time_cell
    fixed, per_unit = cal._probe_attack(None, AttackSpec("learning_to_invert", {}, "learning_to_invert"))
    assert [t["updates"] for t in timed] == [16, 64, 64] and [t["iterations"] for t in timed] == [1, 1, 4]
    assert per_unit == {"updates": pytest.approx(47.5 / 48), "iterations": 0.0}
    assert fixed == pytest.approx(163.5 - 64 * 47.5 / 48)


@pytest.mark.slow
def test_settling_and_a_budget_never_give_a_kinder_verdict_than_the_full_run(write_audit, tmp_path, capsys):
    """The same audit in full, settled (attacks stop once a step's verdict cannot change) and under a budget whose
    plan cut Inverting Gradients to 5 iterations and left out the Bayes adversary: settled, every verdict is the full
    run's; budgeted, each verdict is the full run's or inconclusive, never kinder at any level of the gate. The noisy
    setting, which only the Bayes adversary breaks beyond doubt, judged alone on what the budget ran would protect
    (calibrated by the exact attack on the reference): it reads inconclusive (budget), and the decision ships
    nothing and names the budget that settles it."""
    from conftest import small_audit
    from leakaudit.evaluator.cli import frontier_lines
    from leakaudit.evaluator.results.verdict import verdict_words
    from leakaudit.evaluator.results.verdict import kinder_than
    from leakaudit.evaluator.run.runner import run_audit

    spec = small_audit(model={"name": "mlp", "checkpoints": [0]},
                       data={"dataset": "digits", "image_size": 8, "targets": 2, "batch_size": 1},
                       defenses=[{"name": "none"}, {"name": "gaussian", "params": {"sigma": 0.1}}],
                       attacks=[{"name": "analytic"}, {"name": "inverting_gradients", "params": {"iterations": 300}},
                                {"name": "bayes", "params": {"iterations": 300}}], metrics=["psnr", "label_accuracy"])
    full = run_audit(load_audit(write_audit(spec)), tmp_path / "full", progress=False)
    settled_audit = load_audit(write_audit(spec))
    settled_audit.attack_choice = tuple(f"{a.label}: chosen" for a in settled_audit.attacks)  # as auto marks it
    settled = run_audit(settled_audit, tmp_path / "settled", progress=False)
    assert json.loads((tmp_path / "settled" / "run.json").read_text())["settled"]["skipped"]  # it did settle
    cut = load_audit(write_audit({**spec, "budget": "1m"}))
    est.apply_plan(cut, {"seconds": 60, "estimate": 150.0, "order": ["analytic", "inverting_gradients", "bayes"],
                         "params": {"inverting_gradients": {"iterations": 5}},
                         "dropped": {"bayes": "left out: it needs about 1 min 30 s even at 1/8 of its iterations"},
                         "cut": ["inverting_gradients: iterations 300 -> 5", "bayes: left out"], "skipped": []})
    budgeted = run_audit(cut, tmp_path / "budgeted", progress=False)
    by_step = {(v.setting, v.checkpoint): v for v in full.verdicts}
    assert {k: (v.verdict, v.level) for k, v in by_step.items()} == {
        (v.setting, v.checkpoint): (v.verdict, v.level) for v in settled.verdicts}
    for v in budgeted.verdicts:
        assert v.verdict in (by_step[v.setting, v.checkpoint].verdict, "inconclusive"), v.reason
        assert not kinder_than(v, by_step[v.setting, v.checkpoint])
    noisy = next(v for v in budgeted.verdicts if v.setting == "gaussian(sigma=0.1)")
    assert by_step[noisy.setting, 0].verdict == "leaks" and by_step[noisy.setting, 0].attack == "bayes"
    assert (noisy.verdict, noisy.alone, noisy.calibrated_by) == ("inconclusive", "protects", "analytic")
    assert noisy.budget == ("the budget of 1 min 00 s left out bayes and scaled down inverting_gradients (which at that "
                            "scale did not break the undefended update at the level of individuals); a full run "
                            "attacks this setting at step 0 with them, and takes about 2 min 30 s (budget: 3m, or none)")
    assert kinder_than(dataclasses.replace(noisy, verdict="protects", level="nothing", budget=None),
                       by_step[noisy.setting, 0])  # what the verdict would say without the rule
    worst = next(w for w in budgeted.worst_case if w.setting == noisy.setting)
    assert verdict_words(worst) == "inconclusive (budget)" and worst.budget == noisy.budget
    assert 'class="mark budget"' in (tmp_path / "budgeted" / "report.html").read_text()
    decision = budgeted.decision
    assert decision.setting is None and decision.binds == "budget" and "(budget: 3m, or none)" in decision.reason
    assert frontier_lines(budgeted)[-1].startswith("decision: none to ship (budget binds): the budget of 1 min 00 s "
                                                   "cut attacks that the verdicts of gaussian(sigma=0.1) rest on")


def _step(verdict: str, level: str | None):
    from leakaudit.evaluator.results.types import StepVerdict

    return StepVerdict(setting="gaussian(sigma=0.1)", defense="gaussian", checkpoint=0, attack="analytic", score=9.0,
                       ci=[8.0, 10.0], statistic="mean", compared=9.0, threshold=14.0, accuracy=0.9,
                       min_accuracy=0.5, still_improving=None, settling_iterations=None, verdict=verdict,
                       reason="analytic reaches psnr 9", level=level)


def test_a_budget_leaves_open_only_what_an_attack_it_cut_could_change(write_audit):
    """budget_open on one setting's verdicts: a "protects" whose scaled attack still broke the reference at the
    level of individuals stands; one with an attack left out is inconclusive (budget); a leak of labels says its
    individuals are open (the gate at individuals reads it inconclusive, at labels a leak); a leak of individuals
    is left as it is; a plan that cut nothing changes nothing. The decision ships nothing on an open verdict."""
    from conftest import small_audit
    from leakaudit.evaluator.results.summary import budget_open, decide
    from leakaudit.evaluator.results.types import WorstCase
    from leakaudit.evaluator.results.verdict import gate_reading

    spec = small_audit(attacks=[{"name": "analytic"}, {"name": "inverting_gradients"}, {"name": "bayes"}],
                       model={"name": "mlp", "checkpoints": [0]}, data={"dataset": "digits", "image_size": 8,
                                                                        "targets": 2, "batch_size": 1})
    plan = {"seconds": 60, "estimate": 150.0, "order": ["analytic", "inverting_gradients", "bayes"], "skipped": [],
            "params": {"inverting_gradients": {"iterations": 5}}, "dropped": {}, "cut": ["inverting_gradients: ..."]}
    audit = load_audit(write_audit(spec))
    setting = audit.settings[1]
    same = budget_open(audit, setting, _step("protects", "nothing"), lambda label, step: True)
    assert same == _step("protects", "nothing")  # no plan: nothing cut
    est.apply_plan(audit, plan)
    assert budget_open(audit, setting, _step("protects", "nothing"), lambda label, step: True) == same
    opened = budget_open(audit, setting, _step("protects", "nothing"), lambda label, step: False)
    assert (opened.verdict, opened.alone, opened.level) == ("inconclusive", "protects", None)
    assert opened.reason.startswith("inconclusive (budget): the budget of 1 min 00 s scaled down inverting_gradients")
    dropped = load_audit(write_audit(spec))
    est.apply_plan(dropped, {**plan, "params": {}, "dropped": {"bayes": "left out"}, "cut": ["bayes: left out"]})
    assert [a.label for a in dropped.budget_left_out] == ["bayes"]
    left = budget_open(dropped, dropped.settings[1], _step("protects", "nothing"), lambda label, step: True)
    assert left.verdict == "inconclusive" and "left out bayes;" in left.budget
    labels = budget_open(audit, setting, _step("leaks", "labels"), lambda label, step: True)
    assert (labels.verdict, labels.level) == ("leaks", "labels") and labels.budget
    assert budget_open(audit, setting, _step("leaks", "individuals"), lambda label, step: False) == _step(
        "leaks", "individuals")
    case = WorstCase(defense="gaussian", setting=setting.key, params={}, baseline=False, reference=False, added=False,
                     must_protect=True, accuracy=0.9, epsilon=None, identifiable=None, attack="analytic",
                     checkpoint=0, scores={}, n=2, verdict="leaks", reason="r", verdict_checkpoint=0, level="labels",
                     budget=labels.budget)
    assert gate_reading(case)[0] == "inconclusive" and gate_reading(case, "labels")[0] == "leak"
    # privacy binds on labels; the decision reads the gate's rule: a leak of labels left open by the budget does not
    # pass the default gate, and the decision does not say it does
    bound = decide([case], {}, 0.5, 0.95, plan=plan)
    assert (bound.binds, bound.level) == ("privacy", "labels") and "reads them inconclusive" in bound.reason
    assert "passes them" in decide([dataclasses.replace(case, budget=None)], {}, 0.5, 0.95).reason
    protecting = dataclasses.replace(case, setting="prune", verdict="protects", level="nothing", budget=None)
    shipped = decide([protecting], {}, 0.5, 0.95)
    assert shipped.setting == "prune"
    held = decide([protecting, dataclasses.replace(case, verdict="inconclusive", level=None)], {}, 0.5, 0.95,
                  plan=plan)
    assert held.setting is None and held.binds == "budget"
    assert held.reason.startswith("prune protects at test accuracy 0.900 against the attacks as the budget ran them, "
                                  "but the budget of 1 min 00 s cut attacks that the verdicts of gaussian(sigma=0.1) "
                                  "rest on (inverting_gradients: ...)")
    assert held.reason.endswith("run the audit in full, about 2 min 30 s (budget: 3m, or none), to settle it")


def test_each_attacker_keeps_room_for_its_verdict_before_the_rest(write_audit, monkeypatch):
    """A budget that cannot run every attack still runs each threat model's cheapest one: the honest server's
    cheapest attack is scaled to leave room for the statistics-reading server's at 1/8, where cheapest-first alone
    would spend the whole budget on it and leave the other threat model without a verdict."""
    from leakaudit.attacks.learned import LearningToInvert
    from leakaudit.plugins.attack import SERVER_READING_STATISTICS

    monkeypatch.setattr(LearningToInvert, "attacker", SERVER_READING_STATISTICS)
    audit = _auto_audit(write_audit, "3m")
    cal = FakeCalibration({"inverting_gradients": 0.05, "bayes": 0.1, "cinet": 0.2, "learning_to_invert": 0.04})
    plan = fit_budget(audit, cal, 1)
    assert plan["order"] == ["inverting_gradients", "learning_to_invert", "bayes", "cinet"]
    assert set(plan["dropped"]) == {"bayes", "cinet"}
    # 166.9 s after start, training and report: learning_to_invert needs 4 x (1 + 0.04 x 187.5) = 34 s at 1/8 of its
    # 1500 iterations, so inverting_gradients gets 4 x (1 + 0.05 u) = 132.9 s, u = 644; learning_to_invert the rest
    assert plan["params"]["inverting_gradients"]["iterations"] == 644
    assert plan["params"]["learning_to_invert"]["iterations"] == pytest.approx(188, abs=1)
    est.apply_plan(audit, plan)
    assert predict(audit, cal, 1).total <= 180
