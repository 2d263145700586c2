"""DP-SGD: the update is Opacus's, the likelihood is centred on the clipped mean, epsilon is Opacus's."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import pytest
import torch
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import nn

from leakaudit.defenses.dpsgd import DPSGD, clipped_mean_gradient
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.cli import main
from leakaudit.evaluator.run.scenario import Scenario, loss_fn
from leakaudit.evaluator.run.utility import privacy_spent, training_run
from leakaudit.evaluator.zoo.datasets import load_digits
from leakaudit.evaluator.zoo.models import lenet_zhu
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.protocol import FEDSGD, ClientStep, FedAvg, trainable

from conftest import small_audit

B = 4


def _batch(seed: int = 0):
    torch.manual_seed(seed)
    model = lenet_zhu(1, 10, 16)
    x, y = torch.rand(B, 1, 16, 16), torch.tensor([3, 1, 4, 1])
    return model, x, y


def _per_example_clipped_mean(model, x, y, c):
    """Reference: one backward pass per example, clipped by its own norm, then averaged."""
    total = None
    for i in range(len(x)):
        g = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), trainable(model))
        norm = torch.sqrt(sum((t ** 2).sum() for t in g))
        scaled = [t * min(1.0, c / (norm.item() + 1e-6)) for t in g]
        total = scaled if total is None else [a + b for a, b in zip(total, scaled)]
    return [t / len(x) for t in total]


def test_shared_update_is_opacus_privacy_engine_noisy_gradient_for_the_same_seed():
    model, x, y = _batch()
    shared = DPSGD(noise_multiplier=0.7, max_grad_norm=0.5).share(
        ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(11)))

    reference = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B)
    private, optimiser, _ = PrivacyEngine().make_private(
        module=reference, optimizer=torch.optim.SGD(reference.parameters(), lr=0.0), data_loader=loader,
        noise_multiplier=0.7, max_grad_norm=0.5, poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(11))
    loss_fn(private(x), y).backward()
    optimiser.step()
    expected = [p.grad for p in reference.parameters()]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(shared.tensors, expected))
    assert all(p.grad is None for p in model.parameters())  # the audited model is left untouched


def test_without_noise_the_update_and_the_likelihood_centre_are_the_clipped_mean():
    model, x, y = _batch()
    reference = _per_example_clipped_mean(model, x, y, 0.5)
    shared = DPSGD(noise_multiplier=0.0, max_grad_norm=0.5).share(
        ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(0)))
    centre = clipped_mean_gradient(model, loss_fn, x, y, 0.5)
    for s, c, r in zip(shared.tensors, centre, reference):
        assert torch.allclose(s, r, atol=1e-6) and torch.allclose(c, r, atol=1e-6)
    norms = [torch.sqrt(sum((t ** 2).sum() for t in torch.autograd.grad(
        loss_fn(model(x[i:i + 1]), y[i:i + 1]), trainable(model)))) for i in range(B)]
    assert max(norms) > 0.5  # clipping was active, so the check above is not the plain mean


def test_noise_has_std_noise_multiplier_times_clip_over_batch():
    model, x, y = _batch()
    shared = DPSGD(noise_multiplier=2.0, max_grad_norm=0.5).share(
        ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(3)))
    centre = clipped_mean_gradient(model, loss_fn, x, y, 0.5)
    noise = torch.cat([(s - c).flatten() for s, c in zip(shared.tensors, centre)])
    assert noise.std().item() == pytest.approx(2.0 * 0.5 / B, rel=0.03)


def test_likelihood_is_differentiable_in_the_images_and_prefers_the_true_batch():
    model, x, y = _batch()
    defense = DPSGD(noise_multiplier=0.01, max_grad_norm=0.5)
    shared = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(0)))
    threat = ThreatModel(model=model, loss_fn=loss_fn, input_shape=(1, 16, 16), mean=torch.zeros(1, 1, 1),
                         std=torch.ones(1, 1, 1), num_classes=10, batch_size=B, defense=defense)
    guess = torch.rand(B, 1, 16, 16, requires_grad=True)
    wrong = defense.log_likelihood(shared, defense.candidate_update(threat, guess, y))
    (step,) = torch.autograd.grad(wrong, guess)
    assert step.abs().sum() > 0
    true = defense.log_likelihood(shared, defense.candidate_update(threat, x, y))
    assert true > wrong


@pytest.mark.parametrize("name, cls", [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_epsilon_equals_opacus_accountant(name, cls):
    defense = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, accountant=name)
    accountant = cls()
    for _ in range(300):
        accountant.step(noise_multiplier=1.1, sample_rate=0.02)
    assert defense.privacy_spent(300, 0.02, 1e-5) == pytest.approx(accountant.get_epsilon(delta=1e-5), rel=1e-6)


def test_target_epsilon_solves_the_noise_multiplier():
    defense = DPSGD(target_epsilon=3.0, delta=1e-5, steps=500, sample_rate=0.01)
    assert defense.noise_multiplier > 0.5
    assert defense.privacy_spent(500, 0.01, 1e-5) == pytest.approx(3.0, abs=0.02)
    with pytest.raises(ValueError, match="needs steps and sample_rate"):
        DPSGD(target_epsilon=3.0)


def test_wrap_model_makes_batchnorm_models_opacus_compatible_and_says_what_changed():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(),
                          nn.Linear(4 * 14 * 14, 10))
    defense = DPSGD()
    fixed = defense.wrap_model(model)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fixed.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in fixed.modules())
    assert any("BatchNorm" in c for c in defense.model_changes)
    clean, lenet = DPSGD(), lenet_zhu(1, 10, 16)
    kept = clean.wrap_model(lenet)
    assert [type(m) for m in kept.modules()] == [type(m) for m in lenet.modules()] and clean.model_changes == []



@pytest.mark.slow
def test_audit_rows_carry_opacus_epsilon_and_bayes_attacks_dpsgd(write_audit, tmp_path):
    audit = small_audit(defenses=[{"name": "none"}, {"name": "dpsgd", "params": {"noise_multiplier": 0.5}}],
                        attacks=[{"name": "bayes", "params": {"iterations": 5}}],
                        utility={"train_steps": 6, "batch_size": 8, "delta": 1e-4})
    assert main(["run", str(write_audit(audit)), "--out", str(tmp_path / "out")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    accountant = RDPAccountant()
    accountant.history = [(0.5, 1 / math.ceil(len(load_digits(16).train_x) / 8), 6)]  # Opacus's sample rate
    expected = accountant.get_epsilon(delta=1e-4)
    eps = [r["epsilon"] for r in rows if r["defense"] == "dpsgd"]
    assert len(eps) == 2 and all(e == pytest.approx(expected) for e in eps)
    assert all(r["epsilon"] is None for r in rows if r["defense"] == "none")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["utility"]["dpsgd(noise_multiplier=0.5)"]["epsilon"] == pytest.approx(expected)


def test_utility_training_is_opacus_privacy_engine_and_its_epsilon_is_the_reported_one(write_audit):
    audit = load_audit(write_audit(small_audit(defenses=[{"name": "dpsgd", "params": {"noise_multiplier": 0.8}}],
                                               utility={"train_steps": 6, "batch_size": 8, "delta": 1e-4})))
    scenario, setting = Scenario(audit), audit.settings[0]
    defense = scenario.defense(setting)
    model = scenario.fresh_model(defense)
    before = [p.detach().clone() for p in model.parameters()]
    run = training_run(scenario, setting, 6, defense)
    yielded = list(defense.train(model, run))
    assert len(yielded) == 7 and all(m is model for m in yielded)
    accountant = RDPAccountant()
    accountant.history = [(0.8, run.sample_rate, 6)]  # what Opacus's PrivacyEngine records for this training
    assert privacy_spent(scenario, defense) == pytest.approx(accountant.get_epsilon(1e-4), rel=1e-12)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())  # Opacus's hooks are gone
    rerun = scenario.fresh_model(scenario.defense(setting))
    again = scenario.defense(setting)
    list(again.train(rerun, training_run(scenario, setting, 6, again)))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), rerun.parameters()))  # seeded: same model


def test_utility_training_says_nothing_of_opacus_secure_rng(write_audit):
    """Opacus's "Secure RNG turned off" is no advice for an audit, whose draws are seeded by design: it stays out of
    the terminal (as warnings never raised)."""
    import warnings

    audit = load_audit(write_audit(small_audit(defenses=[{"name": "dpsgd", "params": {"noise_multiplier": 0.8}}],
                                               utility={"train_steps": 2, "batch_size": 8})))
    scenario, setting = Scenario(audit), audit.settings[0]
    defense = scenario.defense(setting)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(defense.train(scenario.fresh_model(defense), training_run(scenario, setting, 2, defense)))
    assert not [w for w in caught if "Secure RNG" in str(w.message)]


@pytest.mark.parametrize("protocol, code", [("fedavg", 0), ({"name": "step", "function": "conftest:small_audit",
                                                               "lr": 0.1}, 2)])
def test_dpsgd_runs_under_fedavg_and_is_refused_under_your_own_step_before_any_work(protocol, code, write_audit,
                                                                                     capsys):
    audit = small_audit(defenses=[{"name": "dpsgd"}], protocol=protocol)
    assert main(["validate", str(write_audit(audit))]) == code
    err = capsys.readouterr().err
    assert ("defenses[0]: dpsgd: dpsgd" in err and "use protocol: fedsgd or fedavg" in err) == (code == 2)


FEDAVG_CASES = [FedAvg(local_epochs=2, local_batch_size=2, local_lr=0.1),
                FedAvg(local_epochs=2, local_batch_size=1, local_lr=0.1, shuffle=True, clients=2)]


@pytest.mark.parametrize("protocol", FEDAVG_CASES, ids=["in order", "shuffled, two clients"])
def test_under_fedavg_without_noise_or_clipping_the_update_is_the_undefended_one(protocol):
    model, x, y = _batch()
    before = [p.detach().clone() for p in model.parameters()]
    shared = DPSGD(noise_multiplier=0.0, max_grad_norm=1e6).share(
        ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(5), protocol))
    clean = ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(5), protocol).clean_update()
    assert shared.metadata == {"protocol": "fedavg"} and shared.batch_size == B
    assert all(torch.allclose(s, c, rtol=1e-5, atol=1e-6) for s, c in zip(shared.tensors, clean))
    assert max(c.abs().max() for c in clean) > 1e-2  # the local steps moved the weights
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the user's model is untouched
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("protocol", FEDAVG_CASES, ids=["in order", "shuffled, two clients"])
def test_under_fedavg_without_noise_the_update_is_the_candidate_of_its_clipped_local_steps(protocol):
    model, x, y = _batch()
    defense = DPSGD(noise_multiplier=0.0, max_grad_norm=0.05).under(protocol)
    shared = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(5), replace(
        protocol, shuffle=False)))
    threat = ThreatModel(model=model, loss_fn=loss_fn, input_shape=(1, 16, 16), mean=torch.zeros(1, 1, 1),
                         std=torch.ones(1, 1, 1), num_classes=10, batch_size=B, defense=defense, protocol=protocol)
    centre = defense.candidate_update(threat, x, y)
    assert all(torch.allclose(s, c, rtol=1e-5, atol=1e-7) for s, c in zip(shared.tensors, centre))
    unclipped = ClientStep(model, loss_fn, x, y, torch.Generator(), protocol).clean_update()
    assert not all(torch.allclose(c, u, rtol=1e-2) for c, u in zip(centre, unclipped))  # the clip was active
    guess = x.clone().requires_grad_()
    (step,) = torch.autograd.grad(defense.log_likelihood(shared, defense.candidate_update(threat, guess + 0.1, y)),
                                  guess)
    assert step.abs().sum() > 0  # differentiable through the unrolled steps


def test_under_fedavg_the_noise_has_std_local_lr_sigma_clip_over_b_times_root_steps():
    """A linear model (the local steps' noise reaches the update through a Jacobian near the identity): over 30
    shares of 650 coordinates, the noise's std is within 3% of local_lr * sigma * C / b * sqrt(steps)."""
    torch.manual_seed(0)
    model, x, y = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), torch.rand(B, 1, 8, 8), torch.tensor([3, 1, 4, 1])
    protocol = FedAvg(local_epochs=2, local_batch_size=2, local_lr=0.05)
    defense = DPSGD(noise_multiplier=2.0, max_grad_norm=0.5).under(protocol)
    threat = ThreatModel(model=model, loss_fn=loss_fn, input_shape=(1, 8, 8), mean=torch.zeros(1, 1, 1),
                         std=torch.ones(1, 1, 1), num_classes=10, batch_size=B, defense=defense, protocol=protocol)
    centre = torch.cat([c.detach().flatten() for c in defense.candidate_update(threat, x, y)])
    gen = torch.Generator().manual_seed(3)
    noise = torch.stack([defense.share(ClientStep(model, loss_fn, x, y, gen, protocol)).flat() - centre
                         for _ in range(30)])
    expected = 0.05 * 2.0 * 0.5 / 2 * math.sqrt(protocol.local_steps(B))
    assert defense.noise_std(B) == pytest.approx(expected, rel=1e-12)
    assert noise.std().item() == pytest.approx(expected, rel=0.03)
    uneven = replace(protocol, local_batch_size=3)  # minibatches of 3 and 1: Opacus divides each by its own size
    assert defense.under(uneven).noise_std(B) == pytest.approx(0.05 * 2.0 * 0.5 * math.sqrt(2 * (1 / 9 + 1)))
    assert DPSGD(noise_multiplier=2.0, max_grad_norm=0.5).noise_std(B) == 2.0 * 0.5 / B  # FedSGD's, as before


def test_privacy_profile_under_fedavg_composes_the_target_s_local_epochs():
    defense = DPSGD(noise_multiplier=1.5)
    assert defense.privacy_profile().mu == 1 / 1.5 and defense.under(FEDSGD).privacy_profile().mu == 1 / 1.5
    assert defense.under(FedAvg(local_epochs=4, local_batch_size=1)).privacy_profile().mu == 2 / 1.5
    assert defense.under(FedAvg(local_epochs=9, clients=3)).privacy_profile().mu == 3 / 1.5
    assert DPSGD(noise_multiplier=0.0).under(FedAvg(local_epochs=4)).privacy_profile().mu == math.inf


@pytest.mark.slow
def test_check_defense_finds_the_fedavg_likelihood_describes_what_is_shared():
    """Its score at the true candidate has the variance its curvature says, within the check's intervals: the
    first-order Gaussian holds at two local steps of 0.1."""
    from leakaudit.evaluator.authoring.defense_check import check_defense

    check = check_defense(DPSGD(noise_multiplier=1.0, max_grad_norm=0.5),
                          protocol=FedAvg(local_epochs=2, local_batch_size=1, local_lr=0.1), shares=64, directions=8)
    assert not check.problems and check.kind == "noisy"


@pytest.mark.slow
def test_audit_of_dpsgd_under_fedavg_reaches_a_report(write_audit, tmp_path):
    audit = small_audit(data={"dataset": "digits", "image_size": 16, "targets": 2, "batch_size": 2},
                        defenses=[{"name": "dpsgd", "params": {"noise_multiplier": 0.5}}],
                        protocol={"name": "fedavg", "local_epochs": 2, "local_batch_size": 1, "local_lr": 0.1},
                        attacks=[{"name": "bayes", "params": {"iterations": 5}}], utility={"train_steps": 0},
                        metrics=["psnr"])
    assert main(["run", str(write_audit(audit)), "--out", str(tmp_path / "out")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert {r["defense"] for r in rows} >= {"dpsgd"} and all(math.isfinite(r["psnr"]) for r in rows)
    (privacy,) = [w["privacy"] for w in json.loads((tmp_path / "out" / "summary.json").read_text())["worst_case"]
                  if w["setting"].startswith("dpsgd")]
    assert privacy["mu"] == pytest.approx(math.sqrt(2) / 0.5) and "2 local DP-SGD steps" in privacy["mechanism"]
    assert (tmp_path / "out" / "report.html").is_file()
