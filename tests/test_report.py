"""The report a team decides from: verdicts against explicit thresholds, intervals, the CI gate, the rebuild."""
from __future__ import annotations

import json
from dataclasses import replace
import shutil
import subprocess

from types import SimpleNamespace
import numpy as np
import pytest
import yaml

from leakaudit.evaluator.results.types import CellResult, LeakThreshold, Scores, WorstCase, WorstImage
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.results.verdict import (
    LEAKS,
    PROTECTS,
    UNUSABLE,
    bootstrap_interval,
    identifiable_share,
    judge,
    label_threshold,
    leak_threshold,
)
from leakaudit.plugins.components import Metric
from leakaudit.testing import assert_protects

from conftest import LEAKAUDIT, small_audit

PSNR = Metric("psnr", None, True, margin=1.0)
MSE = Metric("mse", None, False, margin=0.01)
OPTIONS = {"statistic": "mean", "confidence": 0.95, "bootstrap": 2000, "utility_margin": 0.05, "min_accuracy": None,
           "margin": None, "identifiable": 0.25}
BASELINES = {"random": {"psnr": 6.0, "mse": 0.25}, "grey": {"psnr": 8.5, "mse": 0.14}, "mean": {"psnr": 9.0,
                                                                                               "mse": 0.12}}


def _cell(attack: str, mean: float, ci: tuple[float, float], n: int = 8, identifiable: float | None = None):
    return CellResult(defense="g", setting="g", params={}, attack=attack, role="naive", checkpoint=0, targets=n,
                      accuracy=None, epsilon=None, scores={"psnr": Scores(mean=mean, ci=list(ci), n=n)},
                      identifiable=identifiable, identifiable_n=n)


# --- the statistics, exactly -------------------------------------------------------------------

def test_bootstrap_interval_of_two_values_spans_them_and_repeats_exactly():
    # resampled means of [0, 1] are 0, 0.5 or 1, each end with probability 1/4: the 95% interval is [0, 1]
    assert bootstrap_interval([0.0, 1.0], 0.95, 4000, seed=1) == (0.0, 1.0)
    values = list(np.random.default_rng(0).normal(20.0, 2.0, size=30))
    first = bootstrap_interval(values, 0.95, 2000, seed=7)
    assert first == bootstrap_interval(values, 0.95, 2000, seed=7)  # same seed, same interval
    low, high = first
    assert low < np.mean(values) < high
    # the normal-theory interval of the mean, mean +- 1.96 s / sqrt(n), within 25%
    half = 1.96 * np.std(values, ddof=1) / np.sqrt(len(values))
    assert (high - low) / 2 == pytest.approx(half, rel=0.25)
    assert bootstrap_interval([5.0], 0.95, 2000, seed=0) == (5.0, 5.0)
    assert bootstrap_interval([3.0] * 6, 0.95, 2000, seed=0) == (3.0, 3.0)


def test_identifiable_share_counts_reconstructions_nearest_their_own_original():
    assert identifiable_share(np.array([[0.1, 0.5, 0.5], [0.4, 0.2, 0.9], [0.8, 0.7, 0.3]])) == 1.0
    # the second reconstruction is nearer the first original; ties count against identification
    assert identifiable_share(np.array([[0.1, 0.5, 0.5], [0.1, 0.2, 0.9], [0.3, 0.7, 0.3]])) == pytest.approx(1 / 3)
    assert identifiable_share(np.full((4, 4), 0.2)) == 0.0  # a constant guess identifies nobody


def test_leak_threshold_is_the_better_guess_plus_the_metric_margin():
    assert leak_threshold(BASELINES, PSNR, None) == LeakThreshold(value=10.0, guess="mean", guess_score=9.0, margin=1.0)
    assert leak_threshold(BASELINES, PSNR, 3.0).value == 12.0
    low = leak_threshold(BASELINES, MSE, None)
    assert low.guess == "mean" and low.value == pytest.approx(0.11)  # lower is more leakage: minus the margin
    assert leak_threshold({"grey": {"psnr": None}}, PSNR, None) is None


def test_judge_leaks_protects_and_unusable_with_the_reason():
    t = leak_threshold(BASELINES, PSNR, None)
    strong = [_cell("ig", 14.0, (12.0, 16.0)), _cell("dlg", 13.5, (11.0, 15.0))]
    v = judge(strong, PSNR, t, 0.9, 0.15, 0.1, OPTIONS)
    assert v.verdict == LEAKS and v.attack == "ig"
    assert v.reason == ("ig reaches psnr 14 (95% CI 12 to 16, n=8); dlg is close behind (the intervals overlap); its mean beats "
                           "the leak threshold 10 (mean guess 9 + margin 1)")
    weak = [_cell("ig", 9.5, (8.0, 11.0))]
    assert judge(weak, PSNR, t, 0.9, 0.15, 0.1, OPTIONS).verdict == PROTECTS
    unusable = judge(weak, PSNR, t, 0.11, 0.15, 0.1, OPTIONS)
    assert unusable.verdict == UNUSABLE
    assert unusable.reason.endswith("but test accuracy 0.110 is under 0.150 (chance 0.1 + 0.05)")
    # the stricter statistic turns the same cell into a leak: its interval's leaking end
    assert judge(weak, PSNR, t, 0.9, 0.15, 0.1, {**OPTIONS, "statistic": "ci_bound"}).verdict == LEAKS
    assert judge(weak, PSNR, None, 0.9, 0.15, 0.1, OPTIONS).verdict is None


def test_reconstructions_that_identify_their_originals_leak_beyond_chance_only():
    t = leak_threshold(BASELINES, PSNR, None)
    weak = _cell("bayes", 9.5, (8.0, 11.0), n=32)
    # 11 of 32 nearest their own original: a guess gets 1 in 32; P(X >= 11) under Binomial(32, 1/32) = 1.9e-09
    v = judge([replace(weak, identifiable=11 / 32)], PSNR, t, 0.9, 0.15, 0.1, OPTIONS)
    assert v.verdict == LEAKS and v.level == "individuals"
    assert ("but bayes identifies 11 of 32 images (each reconstruction nearest its own original; a guess: 1 in 32, "
            "p = 1.9e-09), at least the 25% the verdict allows; a weak break: ") in v.reason
    # its mean 9.5 is under the guesses that read nothing of the update (10): a weak break, which as a reference's
    # verdict vouches for no "protects"; its interval straddles the bar, so it is borderline too
    assert v.weak is not None and v.vouches == "nothing" and "straddles the leak threshold 10" in v.borderline
    aware = {**BASELINES, "class_mean": {"psnr": 12.0}}  # bars: individuals 13, labels 10 (the mean image's)
    strong = judge([replace(_cell("bayes", 11.5, (10.8, 12.2), n=32), identifiable=11 / 32)], PSNR,
                   leak_threshold(aware, PSNR, None), 0.9, 0.15, 0.1, OPTIONS, label_threshold(aware, PSNR, None))
    assert (strong.verdict, strong.weak, strong.vouches) == (LEAKS, None, None)  # above the guesses: a real break
    # the same share where the run measured it against a guess that knows the classes, and the classes explain it
    assert judge([replace(weak, identifiable=11 / 32, decoy_p=0.3)], PSNR, t, 0.9, 0.15, 0.1,
                 OPTIONS).verdict == PROTECTS
    assert judge([replace(weak, identifiable=4 / 32)], PSNR, t, 0.9, 0.15, 0.1, OPTIONS).verdict == PROTECTS  # < 25%
    few = _cell("bayes", 9.5, (8.0, 11.0), n=4)  # 2 of 4: P(X >= 2 | 4, 1/4) = 0.26, chance explains it
    assert judge([replace(few, identifiable=0.5)], PSNR, t, 0.9, 0.15, 0.1, OPTIONS).verdict == PROTECTS
    off = {**OPTIONS, "identifiable": None}
    assert judge([replace(weak, identifiable=11 / 32)], PSNR, t, 0.9, 0.15, 0.1, off).verdict == PROTECTS
    text = judge([replace(weak, identifiable=11 / 32)], PSNR, t, 0.9, 0.15, 0.1, {**OPTIONS, "unit": "sentence"})
    assert "bayes identifies 11 of 32 sentences (each" in text.reason  # a text audit counts sentences


def test_summary_intervals_and_verdicts_from_rows(write_audit):
    from leakaudit.evaluator.results.summary import summarise

    audit = load_audit(write_audit(small_audit(defenses=[{"name": "none"}, {"name": "gaussian", "params": {
        "sigma": 1.0}, "must_protect": True}])))
    base = {"params": {}, "attack": "inverting_gradients", "checkpoint": 0, "seconds": 1.0, "ssim": 0.5, "mse": 0.1,
            "label_accuracy": 1.0}
    rows = [{**base, "defense": "none", "setting": "none", "target": t, "psnr": p, "per_image": {"psnr": [p]}}
            for t, p in enumerate([20.0, 22.0])]
    rows += [{**base, "defense": "gaussian", "setting": "gaussian(sigma=1.0)", "target": t, "psnr": p}
             for t, p in enumerate([6.0, 7.0])]
    utility = [{"setting": "none", "accuracy": 0.9}, {"setting": "gaussian(sigma=1.0)", "accuracy": 0.1}]
    summary = summarise(audit, _rows(*rows), utility, [], BASELINES, {"chance_accuracy": 0.1})
    none, noisy = summary.worst_case
    assert none.mean("psnr") == 21.0 and none.ci("psnr") == [20.0, 22.0] and none.n == 2
    assert summary.cells[0].scores["psnr"].std == pytest.approx(np.sqrt(2.0))  # the sample std (n - 1)
    assert none.verdict == LEAKS and noisy.verdict == UNUSABLE and noisy.must_protect
    assert none.worst_image == WorstImage(attack="inverting_gradients", checkpoint=0, score=22.0, target=1, index=0)
    assert summary.min_accuracy == pytest.approx(0.15)
    assert_protects(summary)  # the marked setting does not leak
    with pytest.raises(AssertionError, match=r"^leak: none leaks individuals at step 0: inverting_gradients reaches psnr 21"):
        assert_protects(summary, ["none"])
    # every reconstruction of the marked setting diverged: it is listed as not judged, and the gate fails closed
    diverged = [{**r, "psnr": float("nan"), "per_image": {"psnr": [float("nan")]}} if r["defense"] == "gaussian"
                else r for r in rows]
    summary = summarise(audit, _rows(*diverged), utility, [], BASELINES, {"chance_accuracy": 0.1})
    noisy = summary.worst_case[1]
    assert noisy.verdict is None and noisy.reason.startswith("not judged: no attack scored a finite psnr")
    with pytest.raises(AssertionError, match=r"gaussian\(sigma=1.0\) \(must_protect\) could not be judged"):
        assert_protects(summary)
    # named settings go through the same gate: an unjudged one fails it too
    with pytest.raises(AssertionError, match=r"^unjudged: gaussian\(sigma=1.0\) could not be judged: not judged"):
        assert_protects(summary, ["gaussian(sigma=1.0)"])
    # a budget left out every attack of the marked setting: it is listed, never dropped, and the gate fails closed
    plan = {"dropped": {"inverting_gradients": "left out: it needs about 9 min even at 1/8 of its iterations"}}
    unattacked = summarise(audit, _rows(*rows[:2]), utility, [], BASELINES, {"chance_accuracy": 0.1, "budget": plan})
    noisy = unattacked.worst_case[1]
    assert (noisy.setting, noisy.verdict) == ("gaussian(sigma=1.0)", None)
    assert noisy.reason == ("not judged: no attack ran on it; the budget left out inverting_gradients "
                            "(see the run's budget)")
    with pytest.raises(AssertionError, match=r"gaussian\(sigma=1.0\) \(must_protect\) could not be judged"):
        assert_protects(unattacked)
    # an undefended model that ends its training unusable is a training that does not learn: said, once
    assert unattacked.warnings == []
    stalled = summarise(audit, _rows(*rows), [{**utility[0], "accuracy": 0.12}, utility[1]], [], BASELINES,
                        {"chance_accuracy": 0.1})
    assert stalled.warnings == [
        "none: the undefended model's test accuracy after utility.train_steps 5 is 0.12, under the 0.15 a usable "
        "model needs: its training does not learn, so every setting reads unusable; raise utility.lr or train_steps"]
    # where the update is a model change (FedAvg), the warning says what utility.lr is there
    from leakaudit.plugins.protocol import FedAvg
    audit.protocol = FedAvg(local_batch_size=1)
    averaged = summarise(audit, _rows(*rows), [{**utility[0], "accuracy": 0.12}, utility[1]], [], BASELINES,
                         {"chance_accuracy": 0.1})
    assert averaged.warnings == [stalled.warnings[0] + (
        " (where the update is a model change rather than one gradient, utility.lr is the server's step on the "
        "client's theta_before - theta_after: FedAvg adds it as it is, lr 1.0)")]


# --- a real run: verdicts, the gate both ways, the rebuild, a template --------------------------

def _audit(**changes) -> dict:
    audit = small_audit(defenses=[{"name": "none"}, {"name": "gaussian", "params": {"sigma": 1.0}}],
                        attacks=[{"name": "inverting_gradients", "params": {"iterations": 100, "lr": 0.1,
                                                                           "priors": {"tv": 0.01}}}],
                        utility={"train_steps": 40, "batch_size": 16, "lr": 0.5},
                        # sigma 1.0 trains to 0.13 to 0.17 (AVX-512 against AVX2 kernels): usable from chance + 0.1,
                        # not chance + 0.05, keeps its "unusable" off the knife's edge on every CPU
                        verdict={"utility_margin": 0.1})
    audit.update(changes)
    return audit


def _marked(audit: dict, index: int) -> dict:
    audit = json.loads(json.dumps(audit))
    audit["defenses"][index]["must_protect"] = True
    return audit


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The undefended model and Gaussian sigma 1, run by the command line with the gate on the undefended one."""
    folder = tmp_path_factory.mktemp("report")
    config = folder / "audit.yaml"
    config.write_text(yaml.safe_dump(_marked(_audit(), 0), sort_keys=False))
    out = folder / "run"
    done = subprocess.run([*LEAKAUDIT, "run", str(config), "--out", str(out), "--no-progress", "--fail-on-leak"],
                          capture_output=True, text=True)
    return folder, config, out, done


@pytest.mark.slow
def test_the_gate_fails_a_leaking_must_protect_setting_with_status_3(finished):
    _, _, out, done = finished
    assert done.returncode == 3, done.stderr
    leaks = [line for line in done.stderr.splitlines() if line.startswith("leakaudit: leak: ")]
    assert len(leaks) == 1 and leaks[0].startswith(
        "leakaudit: leak: none (must_protect) leaks individuals at step 0: inverting_gradients reaches psnr ")
    assert (out / "report.html").stat().st_size > 0  # the gate fails after the report is written


@pytest.mark.slow
def test_verdicts_in_the_terminal_summary_json_and_report(finished):
    _, _, out, done = finished
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    assert " LEAKS " in lines["none"] and " PROTECTS BUT UNUSABLE " in lines["gaussian(sigma=1.0)"]
    summary = json.loads((out / "summary.json").read_text())
    verdicts = {w["setting"]: w["verdict"] for w in summary["worst_case"]}
    assert verdicts == {"none": LEAKS, "gaussian(sigma=1.0)": UNUSABLE}
    assert set(summary["baselines"]) == {"random", "grey", "mean", "class_mean"}
    assert " LEAKS INDIVIDUALS " in lines["none"] and summary["worst_case"][0]["level"] == "individuals"
    assert summary["run"]["versions"]["torch"] and summary["run"]["sessions"][0]["seconds"] > 0
    page = (out / "report.html").read_text()
    for text in ("protects but unusable", "Threat model: what the attacker knows", "Provenance", "no guarantee",
                 "<h3>Step 0</h3>", "The most leaking reconstruction of each setting"):
        assert text in page, text
    for w in summary["worst_case"]:  # accuracies side by side in one format: 0.100 beside 0.903, never 0.1
        assert f'<td class="num" data-label="accuracy">{w["accuracy"]:.3f}</td>' in page


@pytest.mark.slow
def test_report_rebuilds_the_same_page_from_the_folder(finished):
    _, _, out, _ = finished
    before = (out / "report.html").read_bytes()
    for name in ("report.html", "summary.json", "privacy_utility.png", "reconstructions_step0.png"):
        (out / name).unlink()
    done = subprocess.run([*LEAKAUDIT, "report", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (out / "report.html").read_bytes() == before


@pytest.mark.slow
def test_the_gate_passes_where_the_marked_setting_protects(finished, tmp_path):
    folder, _, out, _ = finished
    other = tmp_path / "gaussian_marked.yaml"
    other.write_text(yaml.safe_dump(_marked(_audit(), 1), sort_keys=False))
    done = subprocess.run([*LEAKAUDIT, "report", str(out), "--config", str(other), "--fail-on-leak"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "leakaudit: leak" not in done.stderr
    # a stricter verdict: section may rejudge the run; other results may not
    stricter = _marked(_audit(verdict={"min_accuracy": 0.95}), 1)
    other.write_text(yaml.safe_dump(stricter, sort_keys=False))
    done = subprocess.run([*LEAKAUDIT, "report", str(out), "--config", str(other)], capture_output=True, text=True)
    assert done.returncode == 0 and " PROTECTS BUT UNUSABLE " in done.stdout and " LEAKS " in done.stdout
    other.write_text(yaml.safe_dump(_audit(seed=1), sort_keys=False))
    done = subprocess.run([*LEAKAUDIT, "report", str(out), "--config", str(other)], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith(f"leakaudit: error: --config: {other} asks for other results than the run in")


@pytest.mark.slow
def test_a_template_of_ones_own_extends_the_page(finished, tmp_path):
    _, _, out, _ = finished
    mine = tmp_path / "report.html.j2"  # the built-in's own name: it must still extend the built-in, not itself
    mine.write_text('{% extends "report.html.j2" %}{% block header %}<h1>ACME privacy review</h1>{% endblock %}')
    target = tmp_path / "copy"
    shutil.copytree(out, target)
    done = subprocess.run([*LEAKAUDIT, "report", str(target), "--template", str(mine)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    page = (target / "report.html").read_text()
    assert "<h1>ACME privacy review</h1>" in page and "leakaudit: small</h1>" not in page and "Verdicts" in page


@pytest.mark.slow
def test_gate_and_report_refuse_what_they_cannot_do_in_one_line(finished, tmp_path):
    _, config, out, _ = finished
    unmarked = tmp_path / "unmarked.yaml"
    unmarked.write_text(yaml.safe_dump(_audit(), sort_keys=False))
    broken = tmp_path / "broken.html.j2"
    broken.write_text("<h1>\n{% if %}</h1>")
    for args, expected in [
        (["run", str(unmarked), "--out", str(tmp_path / "x"), "--fail-on-leak"],
         f"--fail-on-leak: no defense entry in {unmarked} is marked must_protect: true"),
        (["run", str(config), "--out", str(tmp_path / "y"), "--template", str(tmp_path / "none.j2")],
         f"--template: {tmp_path / 'none.j2'} is not a file"),
        (["run", str(config), "--out", str(tmp_path / "z"), "--template", str(broken)],
         f"--template: {broken}: line 2: Expected an expression"),
        (["report", str(tmp_path)], f"{tmp_path}: not a leakaudit run folder (no audit.yaml)"),
    ]:
        done = subprocess.run([*LEAKAUDIT, *args], capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.splitlines() == [f"leakaudit: error: {expected}"] or \
            done.stderr.startswith(f"leakaudit: error: {expected}"), done.stderr
    assert not any((tmp_path / d).exists() for d in "xyz")


@pytest.mark.slow
def test_an_audit_measuring_ssim_and_mse_gets_verdicts_and_a_plot(write_audit, tmp_path):
    from leakaudit.evaluator.run.runner import run_audit

    audit = load_audit(write_audit(_audit(metrics=["ssim", "mse"])))
    summary = run_audit(audit, tmp_path / "out", progress=False)
    assert summary.leakage_metric == "ssim" and summary.leak_threshold.margin == 0.05
    assert {w.setting: w.verdict for w in summary.worst_case} == {"none": LEAKS,
                                                                           "gaussian(sigma=1.0)": UNUSABLE}
    assert (tmp_path / "out" / "privacy_utility.png").stat().st_size > 0
    assert all(0.0 <= c.identifiable <= 1.0 and c.identifiable_by == "mse" for c in summary.cells)


@pytest.mark.heavy
def test_the_ci_gate_example_passes_its_own_tests(tmp_path):
    """examples/ci-gate, as a team copies it: its pytest file passes (none leaks, its DP-SGD setting protects)."""
    from conftest import ROOT

    done = subprocess.run([LEAKAUDIT[0], "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "examples" / "ci-gate")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "2 passed" in done.stdout


def test_null_turns_a_verdict_option_off_and_keeps_the_default_elsewhere(write_audit):
    audit = load_audit(write_audit(_audit(verdict={"identifiable": None, "margin": None, "min_accuracy": None})))
    assert audit.verdict.identifiable is None and audit.verdict.margin is None
    assert audit.verdict.statistic == "mean" and audit.verdict.utility_margin == 0.05


def test_the_second_views_and_the_identifying_distance_come_from_the_metrics_metadata():
    """No metric name in the engine: the report's second views follow ``Metric.view_rank``, the distance that
    names nearest originals ``Metric.distance_rank`` (the measured one of lowest rank, else MSE)."""
    from types import SimpleNamespace

    from leakaudit.evaluator.results.identify import identifying_metric
    from leakaudit.evaluator.results.summary import second_views
    from leakaudit.plugins.manager import load_registry

    registry = load_registry(entry_points=False)
    views = second_views(registry)
    assert [m for m in views if registry.get("metric", m).modality == "image"] == ["lpips", "ssim", "psnr"]
    assert [m for m in views if registry.get("metric", m).modality == "text"] == ["rouge2", "rouge1"]
    audit = SimpleNamespace(registry=registry, metrics=["psnr", "lpips"])
    assert identifying_metric(audit, _rows({"lpips": 0.3})).name == "lpips"
    assert identifying_metric(audit, _rows({"lpips": None})).name == "mse"  # LPIPS unavailable: the fallback
    assert identifying_metric(SimpleNamespace(registry=registry, metrics=["psnr"]), _rows({})).name == "mse"
    text = SimpleNamespace(registry=registry, metrics=["rouge1", "label_accuracy"])
    assert identifying_metric(text, _rows({})).name == "token_accuracy"  # a text audit's distance is a text one


def test_a_defense_whose_settings_name_different_parameters_draws_its_line(tmp_path):
    """One entry at its defaults beside one that sets a parameter: the figure labels the first 'default'."""
    from leakaudit.evaluator.results.figures import plot_privacy_utility
    from leakaudit.plugins.manager import load_registry

    points = [WorstCase(defense="signsgd", setting=key, params=params, baseline=False, reference=False, added=False,
                        must_protect=False, accuracy=acc, epsilon=None, identifiable=None, attack="ig", checkpoint=0,
                        scores={"psnr": Scores(mean=9.0 + acc, ci=[8.0, 10.0], n=2)}, n=2, verdict="protects",
                        reason="", verdict_checkpoint=0)
              for key, params, acc in [("signsgd", {}, 0.8), ("signsgd(scaled=False)", {"scaled": False}, 0.1)]]
    summary = SimpleNamespace(worst_case=points, leakage_metric="psnr", higher_is_more_leakage=True,
                              leak_threshold=LeakThreshold(value=14.0, guess="mean", guess_score=13.0, margin=1.0),
                              chance_accuracy=0.1, min_accuracy=0.15, frontier=[])
    assert plot_privacy_utility(summary, tmp_path / "pu.png", load_registry(entry_points=False))
    assert (tmp_path / "pu.png").stat().st_size > 0


def _rows(*rows: dict) -> list:
    """Results rows as the summary reads them (``Row``), from the keys a test sets (one attack at step 0 by
    default)."""
    from leakaudit.evaluator.results.rows import Row

    base = {"defense": "none", "setting": "none", "attack": "inverting_gradients", "checkpoint": 0, "target": 0,
            "seconds": 1.0}
    return [Row.from_json({**base, **r}) for r in rows]
