"""The frontier search: the bisection on a verdict, the audit file's frontier: block, and a search run end to end."""
from __future__ import annotations

import json
import math

import pytest
import yaml

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.frontier import midpoint, search
from leakaudit.evaluator.audit.types import ConfigError, FrontierSpec

from conftest import ROOT

ROOT_CONFIGS = ROOT / "configs"


def _spec(low=0.01, high=1.0, protects="higher", integer=False, tolerance=1.25, probes=8) -> FrontierSpec:
    return FrontierSpec("defenses[1]", "gaussian", {}, "sigma", low, high, tolerance, probes, protects, integer)


def _threshold(at: float, protects: str = "higher"):
    """A verdict that protects from ``at`` on (in the knob's protecting direction)."""
    def verdict(value):
        return "protects" if (value >= at if protects == "higher" else value <= at) else "leaks"
    return verdict


def test_bisection_brackets_the_threshold_within_the_tolerance_in_the_probes_the_math_gives():
    """[0.01, 1] is a factor 100: ceil(log2(ln 100 / ln 1.25)) = 5 halvings of the log range after the two ends."""
    found = search(_spec(), _threshold(0.3))
    assert [v for v, _ in found.probes] == [1.0, 0.01, 0.1, 0.316, 0.178, 0.237, 0.274]
    assert found.protecting == 0.316 and found.leaking == 0.274
    assert found.leaking < 0.3 <= found.protecting and found.protecting / found.leaking <= 1.25
    assert found.status.startswith("bracketed within a factor 1.15 in 7 probes")


def test_a_knob_that_protects_as_it_falls_and_an_integer_knob():
    found = search(_spec(0.001, 1.0, "lower"), _threshold(0.05, "lower"))  # top-k: keeping less protects
    assert found.probes[0] == (0.001, "protects") and found.probes[1] == (1.0, "leaks")
    assert found.protecting <= 0.05 < found.leaking and found.leaking / found.protecting <= 1.25
    found = search(_spec(1, 64, "lower", integer=True), _threshold(2, "lower"))  # QSGD levels
    assert (found.protecting, found.leaking) == (2, 3) and all(isinstance(v, int) for v, _ in found.probes)
    assert midpoint(_spec(1, 64, integer=True), 2, 3) is None  # no integer strictly between: the search stops


def test_the_search_says_why_it_stopped_short():
    none = search(_spec(), lambda v: "leaks")
    assert none.protecting is None and none.leaking == 1.0 and "no setting in the range protects" in none.status
    every = search(_spec(), lambda v: "protects but unusable")  # privacy decides the bisection, not utility
    assert every.protecting == 0.01 and every.leaking is None and "every setting in the range protects" in every.status
    stuck = search(_spec(), lambda v: "inconclusive" if v < 1 else "protects")
    assert len(stuck.probes) == 2 and "stopped: sigma=0.01 is inconclusive" in stuck.status
    budget = search(_spec(probes=4), _threshold(0.3))
    assert len(budget.probes) == 4 and "budget of 4 probes is spent" in budget.status


def _write(tmp_path, entry: dict) -> str:
    audit = {"name": "f", "data": {"dataset": "digits", "image_size": 16, "targets": 2, "batch_size": 1},
             "model": {"name": "lenet_zhu", "checkpoints": [0]}, "defenses": [{"name": "none"}, entry],
             "attacks": [{"name": "inverting_gradients", "params": {"iterations": 5}}], "utility": {"train_steps": 0},
             "metrics": ["psnr"]}
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(audit))
    return str(path)


def test_the_ends_are_settings_from_the_start(tmp_path):
    audit = load_audit(_write(tmp_path, {"name": "gaussian", "frontier": {"param": "sigma", "range": [0.01, 1.0]}}))
    assert [s.key for s in audit.settings] == ["none", "gaussian(sigma=0.01)", "gaussian(sigma=1.0)"]
    (spec,) = audit.frontiers
    assert (spec.knob, spec.strong, spec.weak, spec.tolerance, spec.probes) == ("sigma", 1.0, 0.01, 1.25, 8)
    added = audit.add_probe(spec, 0.1)
    assert added.key == "gaussian(sigma=0.1)" and audit.settings[-1] is added


@pytest.mark.parametrize("entry, message", [
    ({"name": "gaussian", "sweep": {"sigma": [0.1]}, "frontier": {"param": "sigma", "range": [0.01, 1]}},
     r"defenses\[1\]: give frontier or sweep, not both"),
    ({"name": "clip", "params": {"max_norm": 1.0}, "frontier": {"param": "max_norm", "range": [0.1, 1]}},
     r"defenses\[1\]\.frontier\.param: 'max_norm' is not a monotone knob of clip; choices: \(none"),
    ({"name": "prune", "frontier": {"param": "fraktion", "range": [0.1, 0.9]}},
     r"defenses\[1\]\.frontier\.param: 'fraktion' is not a parameter of prune \(did you mean 'fraction'\?\); "
     r"choices: fraction, scale"),
    ({"name": "gaussian", "frontier": {"param": "sigma", "range": [1.0, 0.1]}},
     r"defenses\[1\]\.frontier\.range: \[1\.0, 0\.1\]: expected \[low, high\] with 0 < low < high"),
    ({"name": "prune", "frontier": {"param": "fraction", "range": [0.5, 1.5]}},
     r"frontier\.range: \[0\.5, 1\.5\]: expected \[low, high\] with 0 < low < high "
     r"\(1\.5 is above the maximum 0\.99\)"),
    ({"name": "gaussian", "params": {"sigma": 0.1}, "frontier": {"param": "sigma", "range": [0.01, 1]}},
     r"defenses\[1\]\.params\.sigma: the frontier's knob; leave it out of params"),
    ({"name": "gaussian", "frontier": {"param": "sigma", "range": [0.01, 1], "tolerance": 1.0}},
     r"defenses\[1\]\.frontier\.tolerance: 1\.0 must be greater than 1\.0"),
    ({"name": "gaussian", "frontier": {"param": "sigma"}},
     r"defenses\[1\]\.frontier\.range: required parameter is missing"),
])
def test_each_bad_frontier_is_one_line_naming_file_and_key(tmp_path, entry, message):
    path = _write(tmp_path, entry)
    with pytest.raises(ConfigError, match=message) as info:
        load_audit(path)
    assert len(info.value.lines) == 1 and str(info.value).startswith(path)


def _search_audit(tmp_path, **changes) -> str:
    audit = {"name": "search", "seed": 0, "workers": 1,
             "data": {"dataset": "digits", "image_size": 16, "targets": 2, "batch_size": 1},
             "model": {"name": "lenet_zhu", "checkpoints": [0]},
             "defenses": [{"name": "none"},
                          {"name": "gaussian", "frontier": {"param": "sigma", "range": [0.001, 1.0], "tolerance": 10}}],
             "attacks": [{"name": "inverting_gradients", "params": {"iterations": 200, "lr": 0.1}}],
             "utility": {"train_steps": 30, "batch_size": 32, "lr": 0.5}, "metrics": ["psnr", "mse"], **changes}
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(audit, sort_keys=False))
    return str(path)


@pytest.mark.slow
def test_a_search_runs_resumes_and_is_reported_from_its_folder(tmp_path, capsys):
    """The run judges the ends, bisects, and ends with the search's line and the decision; a rerun with --resume
    adds no row; a report rebuilt from the folder finds every probe (frontier.json)."""
    from leakaudit.evaluator.cli import main

    def cli(*args: str) -> list[str]:
        assert main([*args]) == 0
        return capsys.readouterr().out.splitlines()

    path, out = _search_audit(tmp_path), tmp_path / "out"
    lines = cli("run", path, "--out", str(out), "--no-progress")
    summary = json.loads((out / "summary.json").read_text())
    (found,) = summary["frontier"]
    probes = [p["value"] for p in found["probes"]]
    assert probes[:2] == [1.0, 0.001] and len(probes) <= 4 == 2 + math.ceil(math.log2(math.log(1000) / math.log(10)))
    assert json.loads((out / "frontier.json").read_text()) == {"defenses[1]": probes}
    verdicts = {p["value"]: p["verdict"] for p in found["probes"]}
    assert verdicts[1.0] in ("protects", "protects but unusable") and verdicts[0.001] == "leaks"
    assert found["leaking"] < found["protecting"] and found["protecting"] / found["leaking"] <= 10
    assert {p["setting"] for p in found["probes"]} <= {r["setting"] for r in map(
        json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert lines[-2].startswith(f"frontier gaussian sigma: weakest protecting {found['protecting_setting']} (accuracy ")
    assert lines[-1].startswith("decision: ") and summary["decision"]["reason"] in lines[-1]
    # the choice attacked again, with its reference, on 2 fresh targets no probe saw: the next 2 of the seeded order
    fresh_rows = [json.loads(line) for line in (out / "fresh" / "results.jsonl").read_text().splitlines()]
    assert {(r["setting"], r["target"]) for r in fresh_rows} == {
        (s, t) for s in ("none", found["protecting_setting"]) for t in (0, 1)}
    searched = [r["images"] for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())]
    assert not {i for r in fresh_rows for i in r["images"]} & {i for images in searched for i in images}
    assert found["fresh"]["targets"] == 2 and found["fresh"]["verdict"] in ("protects", "protects but unusable",
                                                                             "leaks", "inconclusive")
    assert f"; on 2 fresh targets: {found['fresh']['verdict']}; " in lines[-2]
    rows, fresh = (out / "results.jsonl").read_text(), (out / "fresh" / "results.jsonl").read_text()
    again = cli("run", path, "--out", str(out), "--no-progress", "--resume")
    assert (out / "results.jsonl").read_text() == rows and again[-2:] == lines[-2:]
    assert (out / "fresh" / "results.jsonl").read_text() == fresh
    assert cli("report", str(out))[-2:] == lines[-2:]
    assert json.loads((out / "summary.json").read_text())["frontier"] == summary["frontier"]
    page = (out / "report.html").read_text()
    assert page.index("<h2>Decision</h2>") < page.index("<h2>Verdicts</h2>") and found["protecting_setting"] in page


@pytest.mark.heavy
def test_on_the_quickstart_the_search_brackets_sigma_and_a_grid_agrees(tmp_path):
    """The issue's check: Gaussian noise on the quickstart's model and data, bracketed within a factor 1.25 in at
    most 8 probes; a grid audit at the bracket's two ends gives the verdicts the search gave them."""
    from leakaudit.evaluator.run.runner import run_audit

    quick = yaml.safe_load(open(ROOT_CONFIGS / "quickstart.yaml"))
    search_file = tmp_path / "search.yaml"
    search_file.write_text(yaml.safe_dump({**quick, "defenses": [
        {"name": "none"}, {"name": "gaussian", "frontier": {"param": "sigma", "range": [0.01, 1.0]}}]}))
    (found,) = run_audit(load_audit(search_file), tmp_path / "search", progress=False).frontier
    assert len(found.probes) <= 8 and found.protecting / found.leaking <= 1.25
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump({**quick, "defenses": [
        {"name": "none"}, {"name": "gaussian", "sweep": {"sigma": [found.leaking, found.protecting]}}]}))
    grid = run_audit(load_audit(grid_file), tmp_path / "grid", progress=False)
    judged = {p.setting: p.verdict for p in found.probes}
    for key in (found.leaking_setting, found.protecting_setting):
        assert grid.worst(key).verdict == judged[key]


def test_the_pareto_front_keeps_the_settings_no_other_beats_on_both_axes():
    from types import SimpleNamespace

    from leakaudit.evaluator.results.figures import pareto_front

    def point(name, accuracy, psnr, baseline=False):
        return SimpleNamespace(setting=name, accuracy=accuracy, baseline=baseline, mean=lambda m, v=psnr: v)

    points = [point("none", 0.95, 25.0, baseline=True), point("noise-a", 0.9, 20.0), point("noise-b", 0.5, 8.0),
              point("prune-a", 0.92, 12.0), point("prune-b", 0.6, 7.0), point("prune-c", 0.4, 9.0)]
    # noise-a is beaten by prune-a (more accurate, leaks less); noise-b and prune-c by prune-b
    assert [w.setting for w in pareto_front(points, "psnr", higher_leaks=True)] == ["prune-b", "prune-a"]


def test_the_accuracy_interval_is_wilsons():
    from leakaudit.evaluator.results.summary import accuracy_interval

    low, high = accuracy_interval({"test_images": 100, "accuracy": 0.5}, 0.95)  # the textbook case: 0.404 to 0.596
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    assert accuracy_interval({"accuracy": 0.5}, 0.95) is None  # a row that does not say how many images it counted


def test_the_decision_ships_the_most_accurate_protecting_setting_or_names_what_binds():
    from types import SimpleNamespace

    from leakaudit.evaluator.results.summary import decide

    def case(setting, verdict, accuracy, baseline=False):
        return SimpleNamespace(setting=setting, verdict=verdict, accuracy=accuracy, baseline=baseline, reason="r",
                               level="individuals" if verdict == "leaks" else None, budget=None)

    none = case("none", "leaks", 0.9, baseline=True)
    shipped = decide([none, case("a", "protects", 0.7), case("b", "protects", 0.8), case("c", "leaks", 0.85)], {},
                     0.16, 0.95)
    assert (shipped.setting, shipped.binds, shipped.accuracy) == ("b", None, 0.8)
    # the decision states what the shipped setting costs against the undefended model
    costed = decide([none, case("b", "protects", 0.8)], {}, 0.16, 0.95, {"b": 0.903})
    assert "it keeps the highest test accuracy (0.800); it costs 0.103 in test accuracy against the undefended " \
           "model's 0.903; r" in costed.reason
    utility = decide([none, case("a", "protects but unusable", 0.1), case("c", "leaks", 0.85)], {}, 0.16, 0.95)
    assert (utility.setting, utility.binds) == (None, "utility") and "0.160" in utility.reason
    privacy = decide([none, case("c", "leaks", 0.85), case("d", "inconclusive", 0.8)], {}, 0.16, 0.95)
    assert (privacy.setting, privacy.binds) == (None, "privacy") and "could not be judged" in privacy.reason
    judgement = decide([none, case("d", "inconclusive", 0.8)], {}, 0.16, 0.95)
    assert judgement.binds == "judgement" and decide([none], {}, 0.16, 0.95) is None


def test_a_frontier_choice_that_leaks_on_fresh_targets_is_not_shipped():
    """The decision heeds each frontier choice's verdict on fresh targets: confirmed, it is shipped and the reason
    says so; leaking there, it is not shipped (the next protecting setting is, or privacy binds)."""
    from types import SimpleNamespace

    from leakaudit.evaluator.results.summary import decide

    def case(setting, verdict, accuracy, baseline=False):
        return SimpleNamespace(setting=setting, verdict=verdict, accuracy=accuracy, baseline=baseline, reason="r",
                               level="individuals" if verdict == "leaks" else None, budget=None)

    none, a, b = case("none", "leaks", 0.9, baseline=True), case("a", "protects", 0.7), case("b", "protects", 0.8)
    held = {"verdict": "protects", "targets": 4, "reason": "why"}
    shipped = decide([none, a, b], {}, 0.16, 0.95, confirmed={"b": held})
    assert shipped.setting == "b" and shipped.reason.endswith(
        "Confirmed on 4 fresh targets that took no part in the search: protects (why)")
    refuted = decide([none, a, b], {}, 0.16, 0.95, confirmed={"b": {**held, "verdict": "leaks"}})
    assert refuted.setting == "a" and "not shipped: b, which protected on the searched targets but leaks on fresh " \
                                      "ones" in refuted.reason
    assert refuted.reason.endswith("r. It was not attacked on fresh targets; not shipped: b, which protected on the "
                                   "searched targets but leaks on fresh ones")  # the one shipped instead says so
    alone = decide([none, b], {}, 0.16, 0.95, confirmed={"b": {**held, "verdict": "leaks"}})
    assert (alone.setting, alone.binds) == (None, "privacy")
    unsure = decide([none, b], {}, 0.16, 0.95, confirmed={"b": {**held, "verdict": "inconclusive"}})
    assert unsure.setting == "b" and unsure.reason.endswith(
        "Not confirmed on 4 fresh targets that took no part in the search: inconclusive there (why)")


def test_validate_counts_the_probes_and_the_fresh_targets_confirmation(tmp_path, capsys):
    """validate says what a search may add: its probes' jobs, and the choice attacked again with its reference on
    as many fresh targets."""
    from leakaudit.evaluator.cli import main

    assert main(["validate", _search_audit(tmp_path)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  frontier defenses[1]")]
    assert line.endswith("at most 4 probes, both ends counted above; up to 2 more, one after another, each 30 "
                         "training steps and 2 attack jobs: up to 4 more jobs; then its choice and its undefended "
                         "reference again on 2 fresh targets: 4 more jobs")
