"""``attacks: auto``: the attacks that apply, chosen by what each attack declares, on every shipped config."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from leakaudit.evaluator.audit.auto import choose_attacks
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.run.scenario import Scenario, check_scenario
from leakaudit.evaluator.run.worker import AuditWorker

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

MLP_AUDIT = {
    "name": "auto", "seed": 0, "device": "cpu",
    "data": {"dataset": "digits", "image_size": 16, "targets": 16, "batch_size": 16},
    "model": {"name": "mlp", "checkpoints": [0]},
    "defenses": [{"name": "gaussian", "sweep": {"sigma": [0.01, 0.1]}}, {"name": "precode"}],
    "metrics": ["psnr", "label_accuracy"],
}


def test_no_attacks_key_means_every_attack_that_applies(write_audit):
    audit = load_audit(write_audit(MLP_AUDIT))
    chosen = {a.name: a for a in audit.attacks}
    assert sorted(chosen) == ["bayes", "cinet", "cocktail_party", "inverting_gradients", "learning_to_invert", "spear",
                              "spear_span"]
    assert chosen["inverting_gradients"].params == {"iterations": 1000}  # the CPU's budget
    assert chosen["learning_to_invert"].role == "adaptive" and chosen["spear"].role == "naive"
    by_key = {s.key: s for s in audit.settings}
    precode, noisy = by_key["precode"], by_key["gaussian(sigma=0.1)"]
    assert not chosen["bayes"].applies_to(precode) and chosen["bayes"].applies_to(noisy)  # precode has no likelihood
    assert chosen["spear"].applies_to(precode)
    reference = next(s for s in audit.settings if s.added)
    assert reference.calibrates == set(chosen)  # each runs on the undefended update too
    lines = dict(line.split(": ", 1) for line in audit.attack_choice)
    assert len(lines) == len(audit.registry.entries["attack"])
    assert lines["analytic"].startswith("left out: analytic: exact for one image")
    assert lines["dlg"].startswith("left out: inverting_gradients matches gradients more strongly")
    assert lines["bayes"].startswith("chosen, bayes(iterations=1000); not on precode: bayes: defense 'precode'")
    check_scenario(Scenario(audit))  # every chosen attack passes the checks a listed one must pass


def test_the_budget_is_the_devices(write_audit):
    audit = load_audit(write_audit(MLP_AUDIT))
    chosen = {a.name: a.params for a in choose_attacks(dataclasses.replace(audit, device="cuda"))[0]}
    assert chosen["inverting_gradients"] == {"iterations": 4800} and chosen["learning_to_invert"] == {}


def test_a_listed_attack_is_not_auto_and_a_bad_word_is_one_line(write_audit):
    listed = load_audit(write_audit({**MLP_AUDIT, "attacks": [{"name": "inverting_gradients"}]}))
    assert [a.name for a in listed.attacks] == ["inverting_gradients"] and listed.attack_choice == ()
    with pytest.raises(ConfigError) as exc:
        load_audit(write_audit({**MLP_AUDIT, "attacks": "all"}))
    assert str(exc.value).endswith("attacks: expected auto or a list of {name: ...} entries, got 'all'")


def test_validate_lists_the_choice_and_the_reasons(write_audit, capsys):
    from leakaudit.evaluator.cli import main

    assert main(["validate", str(write_audit({**MLP_AUDIT, "attacks": "auto"}))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("  attacks: auto chose 7 of 29 registered attacks, at their budgets for cpu (list them under "
                      "attacks: to pin the choice):")
    assert "    spear: chosen, spear" in out
    assert "    dager: left out: it reconstructs text" in out  # the data are images
    assert ("    inverting_gradients_bn: left out: bn_prior: update needs a model whose every BatchNorm layer keeps "
            "running statistics") in out  # the MLP has no BatchNorm
    assert any(line.startswith("    fedleak: left out: runs where listed: partial matching and gradient "
                               "regularization") for line in out)
    assert any(line.startswith("    imprint: left out: imprint reads the gradients of an imprint block") for line in out)


#: Where a shipped config reads a torchvision copy that a clean machine lacks: its offline sample of the same shape.
OFFLINE = {"cifar10": "cifar10_samples", "cifar100": "cifar100_samples", "mnist": "mnist_samples"}
#: Budgets small enough to run every chosen attack once per config (the test checks that they run, not how well).
TINY = {"iterations": 1, "updates": 16, "width": 8, "minibatch": 8, "samples": 4096, "dense_limit": 1,
        "cg_iterations": 5, "starts": 8, "steps": 2, "rounds": 1}
#: Configs whose models take over 10 s here even so (64 images through a deep network): run with --runheavy.
HEAVY = {"cinet_batch64", "imprint", "bayesian_full_budget", "text_dager_scale",
         "flower_local_dp"}  # the quickstart's model again: tests/test_flower_dp.py checks auto on Flower's DP


def _auto_version(path: Path, tmp_path: Path) -> Path:
    """The shipped config with its attacks left to auto, on offline data."""
    raw = yaml.safe_load(path.read_text())
    raw.pop("attacks", None)
    data = raw["data"]
    if data["dataset"] in OFFLINE:  # the samples hold 10 images: one target, loaded whole
        raw["data"] = {k: v for k, v in data.items() if k not in ("root", "download", "params")} | {
            "dataset": OFFLINE[data["dataset"]], "targets": 1, "batch_size": 1}
    out = tmp_path / path.name
    out.write_text(yaml.safe_dump(raw))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.heavy) if p.stem in HEAVY else p
                                  for p in sorted(CONFIGS.glob("*.yaml"))], ids=lambda p: p.stem)
def test_auto_validates_and_runs_on_every_shipped_configs_model(path, tmp_path):
    audit = load_audit(_auto_version(path, tmp_path))
    assert audit.attacks and len(audit.attack_choice) == len(audit.registry.entries["attack"])
    scenario = Scenario(audit)
    check_scenario(scenario)
    worker = AuditWorker(scenario, folder=None)
    for spec in audit.attacks:
        setting = next(s for s in audit.settings if spec.applies_to(s))
        defense = scenario.defense(setting)
        worker.provide_states(setting.key, lambda: {0: scenario.fresh_model(defense, setting).state_dict()})
        cls = audit.registry.get("attack", spec.name)
        attack = cls(**{**spec.params, **{k: v for k, v in TINY.items() if k in cls.params}})
        pixels, labels = scenario.target_batch(0, setting)
        read = worker.problems(setting, 0, [(pixels, labels, 0, attack)], "")[0]
        rec = cls.reconstruct_all([read.problem])[0]
        assert rec.images.shape == read.originals.shape, (spec.name, setting.key)
        if scenario.text:  # token ids of the vocabulary
            assert rec.images.dtype == torch.long and 0 <= rec.images.min() <= rec.images.max() < \
                scenario.data.vocab_size, spec.name
        else:
            assert torch.isfinite(rec.images).all() and 0 <= rec.images.min() <= rec.images.max() <= 1, spec.name
        assert len(rec.labels) == len(read.labels), spec.name


def test_the_report_names_what_auto_chose(write_audit):
    from leakaudit.evaluator.results.report import provenance

    audit = load_audit(write_audit(MLP_AUDIT))
    rows = dict(provenance(audit, {"attack_choice": list(audit.attack_choice)}))
    assert rows["Attacks"] == ("attacks: auto chose bayes, cinet, cocktail_party, inverting_gradients, "
                               "learning_to_invert, spear, spear_span; the other 22 registered attacks do not apply "
                               "here or "
                               "another does their work (leakaudit validate says why)")
    assert "Attacks" not in dict(provenance(audit, {}))  # a file that lists its attacks
