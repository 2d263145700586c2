"""What a verdict says leaks: the individuals, the labels alone (class templates), or nothing; the class-aware
guess that tells them apart, the gate's level, and calibration per level."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import small_audit

from leakaudit.evaluator.cli import main
from leakaudit.evaluator.results.types import CellResult, Scores, StepVerdict, Summary
from leakaudit.evaluator.results.verdict import (
    INCONCLUSIVE,
    INDIVIDUALS,
    LABELS,
    LEAKS,
    NOTHING,
    PERSONAL,
    PROTECTS,
    calibrate,
    judge,
    label_threshold,
    leak_threshold,
    min_accuracy,
    overall,
    passive_words,
)
from leakaudit.evaluator.zoo.metrics import class_mean_guess, guess_scores, psnr, text_guess_scores
from leakaudit.plugins.attack import HONEST_SERVER, MALICIOUS_SERVER
from leakaudit.plugins.components import Metric
from leakaudit.testing import assert_protects

PSNR = Metric("psnr", psnr, True, margin=1.0)
OPTIONS = {"statistic": "mean", "confidence": 0.95, "bootstrap": 2000, "utility_margin": 0.05, "min_accuracy": None,
           "margin": None, "identifiable": 0.25}
#: The class means guess 14 dB where the mean image guesses 12: a bar of 15 for individuals, 13 for labels.
BASELINES = {"random": {"psnr": 6.0}, "grey": {"psnr": 8.5}, "mean": {"psnr": 12.0}, "class_mean": {"psnr": 14.0}}


def _cell(mean: float, n: int = 8) -> CellResult:
    return CellResult(defense="g", setting="g", params={}, attack="ig", role="naive", checkpoint=0, targets=n,
                      accuracy=None, epsilon=None, scores={"psnr": Scores(mean=mean, ci=[mean - 1, mean + 1], n=n)})


def test_the_class_aware_guess_is_each_targets_class_mean():
    images = torch.stack([torch.full((1, 2, 2), v) for v in (0.0, 0.2, 1.0, 0.6)])
    labels = torch.tensor([0, 0, 1, 1])
    guess = class_mean_guess(images, labels, torch.tensor([1, 0, 2]), fallback=torch.full((1, 2, 2), 0.5))
    assert guess[:, 0, 0, 0].tolist() == pytest.approx([0.8, 0.1, 0.5])  # class 2: none held, the mean image
    assert class_mean_guess(images, labels, torch.tensor([2])) is None
    # scored like the other guesses: a target equal to its class mean scores the 200 dB cap
    targets = torch.stack([torch.full((1, 2, 2), 0.1), torch.full((1, 2, 2), 0.8)])
    scored = guess_scores([PSNR], [(targets, torch.tensor([0, 1]))], images.mean(dim=0), torch.Generator(),
                          lambda px, y: class_mean_guess(images, labels, y))
    assert scored["class_mean"]["psnr"] == pytest.approx(200.0) and scored["mean"]["psnr"] < 20
    unmade = guess_scores([PSNR], [(targets, torch.tensor([0, 1]))], None, torch.Generator(), lambda px, y: None)
    assert unmade["class_mean"] == {"psnr": None}


def test_a_leak_is_of_individuals_above_the_class_means_and_of_labels_between():
    full, labels = leak_threshold(BASELINES, PSNR, None), label_threshold(BASELINES, PSNR, None)
    assert (full.guess, full.value, labels.guess, labels.value) == ("class_mean", 15.0, "mean", 13.0)
    individuals = judge([_cell(16.0)], PSNR, full, None, None, None, OPTIONS, labels)
    assert (individuals.verdict, individuals.level) == (LEAKS, INDIVIDUALS)
    templates = judge([_cell(14.2)], PSNR, full, None, None, None, OPTIONS, labels)
    assert (templates.verdict, templates.level) == (LEAKS, LABELS)
    assert "shows the labels and class composition (class templates), not the individuals" in templates.reason
    nothing = judge([_cell(12.5)], PSNR, full, None, None, None, OPTIONS, labels)
    assert (nothing.verdict, nothing.level) == (PROTECTS, NOTHING)
    # without a class-aware guess there is no labels bar: every leak is one of individuals, as before
    plain = {k: v for k, v in BASELINES.items() if k != "class_mean"}
    assert label_threshold(plain, PSNR, None) is None
    assert judge([_cell(14.2)], PSNR, leak_threshold(plain, PSNR, None), None, None, None, OPTIONS).level == INDIVIDUALS
    # over the steps a leak of individuals is worse than one of labels
    assert overall([templates, dataclasses.replace(individuals, checkpoint=1)]).level == INDIVIDUALS


ROUGE = Metric("rouge1", None, True, margin=0.05)


def test_personal_values_beyond_a_guess_leak_whatever_the_rouge():
    """A sentence whose ROUGE stays under the bar but that holds a client's name and a number verbatim leaks
    personal values; one that holds no more of them than a guess from the attacker's sentences does not."""
    bar = leak_threshold({"random": {"rouge1": 0.05}, "frequent": {"rouge1": 0.4}}, ROUGE, None)
    noisy = dataclasses.replace(_cell(0.3), scores={"rouge1": Scores(mean=0.3, ci=[0.25, 0.35], n=4)},
                                pii_recall=0.17)
    leaked = judge([noisy], ROUGE, bar, 0.9, 0.5, 0.4, {**OPTIONS, "pii_guess": 0.0})
    assert (leaked.verdict, leaked.level) == (LEAKS, PERSONAL)
    assert leaked.reason.endswith("ig's reconstructions hold 17% of the targets' personal values verbatim (names, "
                                  "numbers), where a guess from the attacker's own sentences holds 0%: beyond it by "
                                  "more than the 5% margin, personal values leak whatever the rouge1")
    assert judge([noisy], ROUGE, bar, 0.9, 0.5, 0.4, {**OPTIONS, "pii_guess": 0.15}).verdict == PROTECTS
    assert judge([noisy], ROUGE, bar, 0.9, 0.5, 0.4, OPTIONS).verdict == PROTECTS  # no guess scored them
    # the guesses score what they hold of each batch's personal values
    ids = torch.tensor([[5, 6, 0], [7, 8, 9]])
    guessed = text_guess_scores([], [(ids, torch.tensor([0, 1]))], torch.tensor([5, 6, 9]), 10, torch.Generator(),
                                recall=lambda guess, index: float((guess == ids).all(1).float().mean()))
    assert guessed["frequent"]["pii_recall"] == 0.5


def _verdict(setting: str, verdict: str, level: str | None) -> StepVerdict:
    return StepVerdict(setting=setting, defense=setting, checkpoint=0, attack="ig", score=14.2, ci=[13.0, 15.0],
                       statistic="mean", compared=14.2, threshold=15.0, accuracy=None, min_accuracy=None,
                       still_improving=None, settling_iterations=None, verdict=verdict, reason="ig reaches psnr 14.2",
                       level=level)


def test_a_reference_broken_only_at_the_class_level_leaves_individuals_inconclusive():
    out = calibrate(_verdict("gaussian", PROTECTS, NOTHING), _verdict("none", LEAKS, LABELS))
    assert out.verdict == INCONCLUSIVE and out.alone == PROTECTS and out.level is None
    assert out.reason.startswith("protects labels, calibrated by ig") and "individuals is inconclusive" in out.reason
    stands = calibrate(_verdict("gaussian", PROTECTS, NOTHING), _verdict("none", LEAKS, INDIVIDUALS))
    assert stands.verdict == PROTECTS and stands.calibrated_by == "ig"
    assert "at the level of individuals" in stands.reason


#: A drop-in attack that reads nothing of the update but its labels: each target's class mean from the attacker's
#: own images, for the labels the threat model gives (threat.known_labels), else those the update shows.
CLASS_TEMPLATES = '''
import torch
import leakaudit
from leakaudit.attacks.labels import recover_labels
from leakaudit.plugins.attack import HONEST_SERVER, Attack, Reconstruction


class ClassTemplates(Attack):
    name = "class_templates"
    paper = "none: the class-template guess of issue 62"
    attacker = HONEST_SERVER  # the labels (known_labels) and data of its own

    def reconstruct(self, observed, threat, generator):
        aux = threat.auxiliary
        images, labels = aux.images[aux.indices], aux.labels[aux.indices]
        targets = recover_labels(observed, threat, "auto", generator)
        out = torch.stack([images[labels == y].float().mean(dim=0) for y in targets.tolist()])
        return Reconstruction(out.to(threat.device), targets, [0.0], 0.0)


@leakaudit.hookimpl
def register_attacks():
    return [ClassTemplates]
'''


def test_class_templates_alone_are_a_leak_of_labels_not_individuals(write_audit, tmp_path, capsys):
    """64 digits at 16 px in updates of 4, undefended and under noise of sigma 0.1: the class means of the
    attacker's own images for the labels the update shows beat the mean image by far, but not each target's class
    mean, and name no more originals among decoys than their classes explain. The default gate passes; --fail-on-leak
    labels fails."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "templates.py").write_text(CLASS_TEMPLATES)
    path = write_audit(small_audit(
        data={"dataset": "digits", "image_size": 16, "targets": 64, "batch_size": 4}, plugins_dir="plugins",
        defenses=[{"name": "none", "must_protect": True},
                  {"name": "gaussian", "params": {"sigma": 0.1}, "must_protect": True}],
        attacks=[{"name": "class_templates"}], utility={"train_steps": 0}, metrics=["psnr"]))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--no-progress", "--fail-on-leak"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    guesses = json.loads((out / "baselines.json").read_text())
    assert guesses["class_mean"]["psnr"] > guesses["mean"]["psnr"] + 1  # the class-aware guess is the bar
    assert summary["leak_threshold"]["guess"] == "class_mean" and summary["label_threshold"]["guess"] == "mean"
    for w in summary["worst_case"]:
        assert w["verdict"] == LEAKS and w["level"] == LABELS, (w["setting"], w["reason"])
        assert w["psnr"] < summary["leak_threshold"]["value"]
    printed = capsys.readouterr().out
    assert " LEAKS LABELS " in printed and "    threat model: honest-but-curious server (" in printed
    assert {w["threat"] for w in summary["worst_case"]} == {"honest-but-curious server"}
    page = (out / "report.html").read_text()
    assert '<small class="level">labels</small>' in page and ">honest-but-curious server</small>" in page
    assert main(["report", str(out), "--fail-on-leak", "labels"]) == 3
    assert "leakaudit: leak: none (must_protect) leaks labels at step 0" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="leaks labels"):
        assert_protects(out, fail_on="labels")
    assert_protects(out)
    decision = summary["decision"]  # the decision names the level privacy binds on, as the gate reads it
    assert decision["binds"] == "privacy" and decision["level"] == LABELS
    assert "none need leak individuals, so the gate at its default level" in decision["reason"]


def test_labels_the_threat_model_grants_are_no_leak_from_the_update(write_audit, tmp_path, capsys):
    """With threat.known_labels the class templates show nothing the attacker did not have: an exact attack breaks
    the undefended update at the level of individuals and vouches for the noisy setting, which protects at the level
    of individuals and of labels; the decision ships it and the gate at either level passes, as the decision says."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "templates.py").write_text(CLASS_TEMPLATES)
    path = write_audit(small_audit(
        data={"dataset": "digits", "image_size": 8, "targets": 16, "batch_size": 1}, plugins_dir="plugins",
        model={"name": "mlp", "checkpoints": [0]}, threat={"known_labels": True},
        defenses=[{"name": "none"}, {"name": "gaussian", "params": {"sigma": 1.0}, "must_protect": True}],
        attacks=[{"name": "class_templates"}, {"name": "analytic"}], utility={"train_steps": 0}, metrics=["psnr"]))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--no-progress", "--fail-on-leak", "labels"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "label_threshold" not in summary and summary["leak_threshold"]["guess"] == "class_mean"
    none, noisy = summary["worst_case"]
    assert (none["verdict"], none["level"], none["attack"]) == (LEAKS, "individuals", "analytic")
    assert (noisy["verdict"], noisy["level"]) == (PROTECTS, NOTHING), noisy["reason"]
    assert "calibrated by analytic" in noisy["reason"]
    templates = next(v for v in summary["cells"] if v["setting"] == noisy["setting"] and v["attack"] == "class_templates")
    baselines = json.loads((out / "baselines.json").read_text())
    assert templates["psnr_mean"] == pytest.approx(baselines["class_mean"]["psnr"], abs=1e-3)  # the granted guess
    assert summary["decision"]["setting"] == noisy["setting"]
    assert_protects(out, fail_on="labels")


def test_every_registered_attack_declares_the_attacker_it_needs(registry):
    from leakaudit.plugins.attack import ATTACKERS, MALICIOUS_SERVER
    from leakaudit.plugins.manager import facts

    declared = {name: registry.get("attack", name).attacker for name in registry.names("attack")}
    assert all(who in ATTACKERS for who in declared.values()), declared
    assert declared["imprint"] == MALICIOUS_SERVER and declared["inverting_gradients"] == "honest-but-curious server"
    assert facts(registry.entries["attack"]["imprint"])["attacker"].startswith("malicious server: changes the model")


def test_a_gate_level_that_is_not_one_is_one_line_naming_the_choices(write_audit, capsys):
    path = write_audit(small_audit(defenses=[{"name": "none", "must_protect": True}]))
    assert main(["validate", str(path)]) == 0
    assert "threat models (the least attacker each attack needs, Carletti et al. 2025): inverting_gradients: " \
           "honest-but-curious server" in capsys.readouterr().out
    assert main(["run", str(path), "--out", "unused", "--fail-on-leak", "label"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--fail-on-leak: 'label' is not a level (did you mean 'labels'?); choices: individuals, labels")


def test_usable_is_relative_to_the_undefended_model():
    """A defense that keeps 0.471 where the undefended model reaches 0.903 is far above chance (0.1 + 0.05) but
    costs more than utility.max_drop: it is unusable, and the reason says by what rule."""
    options = {**OPTIONS, "max_drop": 0.05, "undefended": 0.903}
    needed = min_accuracy(options, 0.1, 0.903, 0.05)
    assert needed == pytest.approx(0.853) and min_accuracy(options, 0.1) == pytest.approx(0.15)
    assert min_accuracy({**options, "min_accuracy": 0.5}, 0.1, 0.903, 0.05) == 0.5  # min_accuracy overrides
    costly = judge([_cell(9.0)], PSNR, leak_threshold(BASELINES, PSNR, None), 0.471, needed, 0.1, options)
    assert costly.verdict == "protects but unusable"
    assert costly.reason.endswith("but test accuracy 0.471 is under 0.853 (the undefended model's 0.903 - max_drop 0.05)")


def test_a_max_drop_out_of_range_is_one_line_naming_the_key(write_audit, capsys):
    path = write_audit(small_audit(utility={"train_steps": 0, "max_drop": 1.5}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "utility.max_drop" in err[0] and "1.5" in err[0], err


def test_each_threat_model_is_judged_on_the_attacks_its_attacker_can_run(write_audit, tmp_path, capsys):
    """A malicious server's imprint block reaches every image; 20 iterations of gradient matching reach none. The
    verdict holds against the malicious server, and says in words that the passive attack named does not reach
    individuals; each threat model's verdict is calibrated on its own attacks."""
    audit = small_audit(name="threats", data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 4},
                        model={"name": "imprint", "params": {"base": "lenet_zhu", "bins": 64}, "checkpoints": [0]},
                        defenses=[{"name": "none"}, {"name": "gaussian", "params": {"sigma": 1.0}}],
                        attacks=[{"name": "imprint"}, {"name": "inverting_gradients", "params": {"iterations": 20}}],
                        utility={"train_steps": 0}, metrics=["psnr", "ssim", "label_accuracy"])
    assert main(["run", str(write_audit(audit)), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    summary = Summary.from_json(json.loads((tmp_path / "run" / "summary.json").read_text()))
    worst = {w.setting: w for w in summary.worst_case}
    none, noisy = worst["none"], worst["gaussian(sigma=1.0)"]
    assert (none.verdict, none.level, none.threat) == (LEAKS, INDIVIDUALS, MALICIOUS_SERVER)
    assert [(t.threat, t.verdict, t.attacks) for t in none.by_threat] == [
        (HONEST_SERVER, INCONCLUSIVE, ["inverting_gradients"]), (MALICIOUS_SERVER, LEAKS, ["imprint", "inverting_gradients"])]
    assert ("protects individuals against the named passive attacks (inverting_gradients, inconclusive"
            in none.reason and "a malicious server reaches them (imprint, step 0)" in none.reason)
    # the noise stops the imprint block: a "protects" vouched for by the malicious server's attack alone, never
    # said of the honest server, whose attack breaks no undefended update
    assert noisy.verdict == PROTECTS and noisy.by_threat[0].verdict == INCONCLUSIVE
    assert passive_words(noisy.by_threat) is None
    assert "by threat model: honest-but-curious server: inconclusive (inverting_gradients, step 0); malicious " \
           "server: protects (imprint, step 0)" in out
    steps = [v for v in summary.verdicts if v.setting == "none"]
    assert steps[0].by_threat == none.by_threat  # one step: its verdicts are the worst case's
    html = (tmp_path / "run" / "report.html").read_text()
    assert "by threat model:" in html and "malicious server: leaks individuals (imprint, step 0)" in html


def test_an_audit_of_one_threat_model_has_no_verdict_per_threat(write_audit, tmp_path):
    assert main(["run", str(write_audit(small_audit())), "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert all("by_threat" not in w for w in summary["worst_case"])
