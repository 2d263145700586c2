"""Soteria, PRECODE and Bayesian layers, and the attacks that know them (issue 6)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leakaudit.attacks.analytic import AnalyticInversion
from leakaudit.attacks.bayesian import (
    BayesianExact,
    BayesianNoiseKL,
    data_gradients,
    kl_to_standard_normal,
    recover_noise,
)
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.attacks.labels import labels_from_signs
from leakaudit.attacks.precode import PrecodeSample, recover_sample
from leakaudit.defenses.bayesian import Bayesian, bayesian_layers, collapse
from leakaudit.defenses.noise import NoDefense
from leakaudit.defenses.precode import Precode, bottleneck_of
from leakaudit.defenses.soteria import Soteria, feature_scores, pruning_mask
from leakaudit.evaluator.cli import main
from leakaudit.evaluator.zoo.models import convbig, lenet_zhu, mlp
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.protocol import FEDSGD, ClientStep, FedAvg, parameter_names

from conftest import small_audit


def loss_fn(logits, targets):
    return F.cross_entropy(logits, targets)


def threat_for(model, defense, shape=(3, 16, 16), labels=None, batch=1):
    return ThreatModel(model, loss_fn, shape, torch.zeros(shape[0], 1, 1), torch.ones(shape[0], 1, 1), 10, batch,
                       defense, labels=labels)


def psnr(a, b):
    return float(-10 * torch.log10(((a - b) ** 2).mean()))


def replay_noise(model, seed, batch=1):
    """The draws the model's Bayesian layers made from a generator seeded with ``seed``, in forward order."""
    gen = torch.Generator().manual_seed(seed)
    return {n: [torch.randn(s, generator=gen) for s in layer.noise_shapes(batch)]
            for n, layer in bayesian_layers(model).items()}


# --- Soteria ------------------------------------------------------------------------------------

def small_convbig():
    torch.manual_seed(0)
    return convbig(3, 10, 12)


def test_soteria_scores_are_the_reference_loop_one_feature_at_a_time():
    model, x = small_convbig(), torch.rand(2, 3, 12, 12)
    scores = feature_scores(model, model.fc1, x)
    xr = x.clone().requires_grad_(True)
    r = model.flatten(model.pool2(model.relu2(model.conv2(model.pool1(model.relu1(model.conv1(xr)))))))
    expected = torch.zeros(r.shape[1])
    live = (r != 0).any(dim=0)
    for f in range(r.shape[1]):
        (dx,) = torch.autograd.grad(r[:, f].sum(), xr, retain_graph=True)
        per_example = dx.flatten(1).norm(dim=1) / r[:, f].detach().abs()
        expected[f] = torch.where(r[:, f] != 0, per_example, torch.zeros(())).sum()
    assert torch.equal(scores.isnan(), ~live)
    torch.testing.assert_close(scores[live], expected[live], rtol=1e-5, atol=1e-6)


def test_soteria_zeroes_the_lowest_scoring_columns_of_one_layer_and_nothing_else():
    model, x, y = small_convbig(), torch.rand(1, 3, 12, 12), torch.tensor([3])
    defense = Soteria(fraction=0.8)
    defense.wrap_model(model)
    assert defense.layer_name == "fc1"  # 'largest'
    step = ClientStep(model, loss_fn, x, y, torch.Generator())
    clean = dict(zip(parameter_names(model), step.clean_update()))
    sent = defense.share(step)
    scores = feature_scores(model, model.fc1, x)
    live = int((~scores.isnan()).sum())
    mask = pruning_mask(scores, 0.8)
    assert int((mask == 0).sum()) == int(0.8 * live)
    for name, tensor in zip(sent.names, sent.tensors):
        expected = clean[name] * mask if name == "fc1.weight" else clean[name]
        assert torch.equal(tensor, expected), name
    assert defense.defended_tensors(sent.names) == {"fc1.weight"}


def test_soteria_likelihood_ignores_the_defended_layer_only():
    model, x, y = small_convbig(), torch.rand(1, 3, 12, 12), torch.tensor([1])
    defense = Soteria(layer="fc2", fraction=0.5)
    defense.wrap_model(model)
    sent = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator()))
    candidate = [t.clone() for t in sent.tensors]
    assert defense.log_likelihood(sent, candidate).item() == 0.0
    i = sent.names.index("fc2.weight")
    candidate[i] = candidate[i] + 1.0
    assert defense.log_likelihood(sent, candidate).item() == 0.0
    j = sent.names.index("fc3.bias")
    candidate[j] = candidate[j] + 1.0
    assert defense.log_likelihood(sent, candidate).item() == pytest.approx(-0.5 * 10)


@pytest.mark.slow
def test_dropping_the_soteria_layer_breaks_it_where_the_full_update_does_not():
    """Balunovic et al. 2022, Sec. 5: cosine matching on every layer but the defended one."""
    model, y = small_convbig(), torch.tensor([2])
    x = torch.rand(1, 3, 12, 12)
    defense = Soteria(fraction=0.8)
    defense.wrap_model(model)
    sent = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator()))
    threat = threat_for(model, defense, (3, 12, 12), labels=y)
    naive = InvertingGradients(iterations=150, priors={"tv": 4e-4})
    adaptive = InvertingGradients(iterations=150, priors={"tv": 4e-4}, drop_defended=True)
    assert adaptive.knows_defense and not naive.knows_defense
    n = psnr(naive(sent, threat, torch.Generator().manual_seed(1)).images, x)
    a = psnr(adaptive(sent, threat, torch.Generator().manual_seed(1)).images, x)
    assert a > n + 3, (a, n)


def test_convbig_is_balunovic_2022_table_3():
    model = convbig(3, 10, 32)
    assert [type(m).__name__ for m in model] == ["Conv2d", "ReLU", "AvgPool2d", "Conv2d", "ReLU", "AvgPool2d",
                                                 "Flatten", "Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert (model.fc1.in_features, model.fc1.out_features, model.fc2.out_features) == (5184, 2000, 1000)
    assert model.conv2.kernel_size == (1, 1) and model.conv2.padding == (1, 1)


# --- PRECODE ------------------------------------------------------------------------------------

def precode_mlp(seed=0):
    torch.manual_seed(seed)
    defense = Precode(size=32)
    return defense.wrap_model(mlp(3, 10, 16, width=64, depth=4)), defense


def test_precode_inserts_a_fresh_sample_bottleneck_before_the_last_layer():
    model, defense = precode_mlp()
    assert isinstance(model[9][0], type(bottleneck_of(model))) and isinstance(model[9].layer, nn.Linear)
    assert defense.model_changes == ["9: variational bottleneck of size 32 inserted before it (64 -> 2x32 -> 32 -> 64)"]
    x = torch.rand(1, 3, 16, 16)
    assert not torch.equal(model(x), model(x))
    block = bottleneck_of(model)
    block.generator = torch.Generator().manual_seed(3)
    first = model(x)
    block.generator = torch.Generator().manual_seed(3)
    assert torch.equal(first, model(x))


def test_precode_trains_with_its_kl_term():
    model, defense = precode_mlp()
    x, y = torch.rand(1, 3, 16, 16), torch.tensor([4])
    logits = model(x)
    block = bottleneck_of(model)
    mu, scale = block.statistics(model[:9](x))
    kl = 0.5 * (mu ** 2 + scale ** 2 - 2 * scale.log() - 1).sum()
    total = defense.client_loss(model, loss_fn)(logits, y)
    assert total.item() == pytest.approx(loss_fn(logits, y).item() + 1e-3 * kl.item(), rel=1e-6)


def test_precode_on_an_mlp_falls_to_the_analytic_attack():
    model, defense = precode_mlp()
    x, y = torch.rand(1, 3, 16, 16), torch.tensor([7])
    sent = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(0)))
    rec = AnalyticInversion()(sent, threat_for(model, defense), torch.Generator())
    assert psnr(rec.images, x) > 60
    assert rec.labels.tolist() == [7]


def test_the_bottleneck_sample_is_read_from_the_decoder_gradients():
    model, defense = precode_mlp()
    x, y = torch.rand(1, 3, 16, 16), torch.tensor([5])
    sent = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(11)))
    block = bottleneck_of(model)
    mu, scale = block.statistics(model[:9](x))
    eps = torch.randn(mu.shape, generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(recover_sample(sent, model), (mu + scale * eps).detach(), rtol=1e-4, atol=1e-5)


def test_precode_sample_attack_applies_only_where_the_sample_is_identifiable():
    model, _ = precode_mlp()
    assert PrecodeSample().unsupported(model, 1, FEDSGD) is None
    assert "one image" in PrecodeSample().unsupported(model, 2, FEDSGD)
    assert "no PRECODE bottleneck" in PrecodeSample().unsupported(mlp(3, 10, 16), 1, FEDSGD)


def test_a_pinned_sample_makes_the_client_update_exactly_reproducible():
    """At the true image the attacker's candidate update equals the shared one."""
    model, defense = precode_mlp()
    x, y = torch.rand(1, 3, 16, 16), torch.tensor([5])
    sent = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(2)))
    from leakaudit.defenses.precode import pinned_sample

    with pinned_sample(model, recover_sample(sent, model)):
        candidate = threat_for(model, defense).candidate_update(x, y)
    for o, c in zip(sent.tensors, candidate):
        torch.testing.assert_close(c, o, rtol=1e-3, atol=1e-6)


# --- Bayesian layers ----------------------------------------------------------------------------

def bayesian_lenet(seed=0, **params):
    torch.manual_seed(seed)
    plain = lenet_zhu(3, 10, 16)
    defense = Bayesian(**params)
    return plain, defense.wrap_model(lenet_zhu_copy(plain)), defense


def lenet_zhu_copy(model):
    import copy

    return copy.deepcopy(model)


def test_conversion_keeps_the_weights_as_means_and_samples_around_them():
    plain, model, defense = bayesian_lenet()
    assert sorted(bayesian_layers(model)) == ["0", "2", "4", "7"]
    assert len(defense.model_changes) == 4
    x = torch.rand(2, 3, 16, 16)
    zero = {n: [torch.zeros(s) for s in layer.noise_shapes(2)] for n, layer in bayesian_layers(model).items()}
    torch.testing.assert_close(collapse(model, zero)(x), plain(x))
    assert not torch.equal(model(x), model(x))


def test_bayesian_kl_term_is_the_closed_form():
    _, model, defense = bayesian_lenet(kl_weight=0.5, prior_sigma=2.0, init_scale=0.1)
    layer = bayesian_layers(model)["7"]
    mu, s = layer.weight_mu, torch.tensor(0.1)
    expected = (torch.log(2.0 / s) + (s ** 2 + mu ** 2) / 8 - 0.5).sum()
    expected = expected + (torch.log(2.0 / s) + (s ** 2 + layer.bias_mu ** 2) / 8 - 0.5).sum()
    torch.testing.assert_close(layer.kl_divergence(), expected, rtol=1e-5, atol=1e-5)


def test_shared_mean_and_scale_gradients_reveal_the_sampled_noise_exactly():
    _, model, defense = bayesian_lenet(kl_weight=0.0)
    x, y = torch.rand(1, 3, 16, 16), torch.tensor([6])
    sent = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(9)))
    noise, identified = recover_noise(data_gradients(sent, model, 0.0), model)
    assert identified == 1.0  # sigmoid network: no gradient is exactly zero
    for name, draws in replay_noise(model, 9).items():
        for true, found in zip(draws, noise[name]):
            torch.testing.assert_close(found, true, rtol=0, atol=2e-5)


def test_with_a_kl_term_the_noise_is_exact_up_to_the_precision_of_the_shared_tensors():
    _, model, defense = bayesian_lenet(kl_weight=1e-3)
    x, y = torch.rand(1, 3, 16, 16), torch.tensor([6])
    sent = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(9)))
    grads = data_gradients(sent, model, 1e-3)
    noise, _ = recover_noise(grads, model)
    shared = dict(zip(sent.names, sent.tensors))
    for name, draws in replay_noise(model, 9).items():
        layer = bayesian_layers(model)[name]
        for (mu, rho), part, true, found in zip(layer.pairs(), ("weight", "bias"), draws, noise[name]):
            # eps = g_rho / (g_mu * sigmoid(rho)): its error is the float32 rounding of the shared g_rho
            bound = 4 * torch.finfo(torch.float32).eps * shared[f"{name}.{part}_rho"].abs() \
                / (grads[f"{name}.{part}_mu"].abs() * torch.sigmoid(rho.detach())) + 1e-5
            assert ((found - true).abs() <= bound).all(), name


def test_bayesian_exact_rebuilds_what_the_attack_on_the_deterministic_network_rebuilds():
    _, model, defense = bayesian_lenet(kl_weight=0.0)
    x, y = torch.rand(1, 3, 16, 16), torch.tensor([2])
    sent = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(4)))
    rec = BayesianExact(iterations=40)(sent, threat_for(model, defense), torch.Generator().manual_seed(1))
    fixed = collapse(model, replay_noise(model, 4))
    step = ClientStep(fixed, loss_fn, x, y, torch.Generator())
    from leakaudit.plugins.defense import SharedUpdate

    plain = SharedUpdate(step.clean_update(), parameter_names(fixed), 1)
    reference = InvertingGradients(iterations=40)(plain, threat_for(fixed, NoDefense()), torch.Generator().manual_seed(1))
    torch.testing.assert_close(rec.images, reference.images, rtol=0, atol=1e-4)
    assert rec.labels.tolist() == [2]


def test_labels_come_from_the_mean_weights_of_a_bayesian_last_layer():
    """Chen et al. 2024, appendix A: the sign rule holds for the means' gradient."""
    _, model, defense = bayesian_lenet(layers="last")
    for label in range(10):
        sent = defense.share(ClientStep(model, loss_fn, torch.rand(1, 3, 16, 16), torch.tensor([label]),
                                        torch.Generator().manual_seed(label)))
        assert sent.names[-2:] == ["7.weight_mu", "7.bias_mu"]
        assert labels_from_signs(sent, 1).tolist() == [label]


def test_bayesian_exact_says_when_the_noise_is_not_identifiable():
    _, mean_only, _ = bayesian_lenet(share_scales=False)
    assert "only the means are shared" in BayesianExact().unsupported(mean_only, 1, FEDSGD)
    _, per_example, _ = bayesian_lenet(noise="per_example")
    assert BayesianExact().unsupported(per_example, 1, FEDSGD) is None
    assert "each example draws its own noise" in BayesianExact().unsupported(per_example, 2, FEDSGD)
    _, model, _ = bayesian_lenet()
    assert "FedAvg" in BayesianExact().unsupported(model, 1, FedAvg())
    assert "no Bayesian layers" in BayesianExact().unsupported(lenet_zhu(3, 10, 16), 1, FEDSGD)
    assert BayesianNoiseKL().unsupported(mean_only, 4, FEDSGD) is None


def test_per_example_noise_draws_one_weight_per_example():
    _, model, _ = bayesian_lenet(noise="per_example", layers="last")
    x = torch.rand(1, 3, 16, 16).expand(2, 3, 16, 16)
    out = model(x)
    assert not torch.allclose(out[0], out[1])


def test_the_noise_regulariser_is_the_kl_of_the_draws_moments():
    eps = torch.tensor([1.0, 3.0])
    m, s = 2.0, 2 ** 0.5
    assert kl_to_standard_normal(eps).item() == pytest.approx(0.5 * (-2 * torch.log(torch.tensor(s)).item()
                                                                     + s ** 2 + m ** 2 - 1))


def test_bayesian_kl_optimises_the_noise_with_the_image():
    _, model, defense = bayesian_lenet(kl_weight=0.0, layers="last")
    x, y = torch.rand(1, 3, 16, 16), torch.tensor([3])
    sent = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(4)))
    attack = BayesianNoiseKL(iterations=30)
    start = torch.Generator().manual_seed(1)
    rec = attack(sent, threat_for(model, defense), start)
    first = torch.Generator().manual_seed(1)
    torch.randn((1, 3, 16, 16), generator=first)  # the start image, then the noise's start
    initial = torch.randn((10, 192), generator=first)
    assert not torch.allclose(rec.extras["noise"]["7"][0], initial)


# --- audit files --------------------------------------------------------------------------------

def test_a_layer_the_model_lacks_is_refused_before_work(write_audit, capsys):
    path = write_audit(small_audit(defenses=[{"name": "bayesian", "params": {"layers": ["fc9"]}}]))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"leakaudit: error: {path}: defenses: bayesian(layers=['fc9']): bayesian: layers 'fc9' are not "
                   "Linear or Conv2d layers of the model; choices: all, last, 0, 2, 4, 7")


def test_an_adaptive_attack_on_a_defense_it_does_not_fit_is_refused(write_audit, capsys):
    path = write_audit(small_audit(defenses=[{"name": "none"}, {"name": "bayesian"}],
                                   attacks=[{"name": "bayesian_exact"}]))
    assert main(["validate", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"leakaudit: error: {path}: attacks[0]: on none: bayesian_exact: the model has no Bayesian layers "
        "(defense bayesian)")
    path = write_audit(small_audit(defenses=[{"name": "none"}, {"name": "bayesian"}],
                                   attacks=[{"name": "bayesian_exact", "defenses": ["bayesian"]}]))
    assert main(["validate", str(path)]) == 0


@pytest.mark.parametrize("audit, expected", [
    (small_audit(attacks=[{"name": "inverting_gradients", "defenses": ["sotera"]}]),
     "attacks[0].defenses: 'sotera' is not a registered defense or a setting label (did you mean 'soteria'?); "
     "choices: ats, bayesian, clip, dpsgd"),
    (small_audit(attacks=[{"name": "inverting_gradients", "defenses": ["soteria"]}]),
     "attacks[0].defenses: no setting of this audit uses soteria; defenses here: gaussian, none"),
    (small_audit(attacks=[{"name": "inverting_gradients", "role": "strong"}]),
     "attacks[0].role: 'strong' is not one of the choices; choices: naive, adaptive"),
    (small_audit(defenses=[{"name": "precode", "model": {"name": "mlpp"}}]),
     "defenses[0].model.name: 'mlpp' is not a registered model or a 'package.module:factory' (did you mean 'mlp'?); choices: "),
    (small_audit(defenses=[{"name": "precode", "model": {"name": "mlp", "params": {"depth": -1}}}]),
     "defenses[0].model.params.depth: -1 is below the minimum 0"),
    (small_audit(defenses=[{"name": "bayesian", "params": {"noise": "per_batch"}}]),
     "defenses[0].params.noise: 'per_batch' is not one of the choices; choices: per_pass, per_example"),
])
def test_new_audit_keys_fail_with_one_line(write_audit, audit, expected):
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.audit.types import ConfigError

    path = write_audit(audit)
    with pytest.raises(ConfigError) as info:
        load_audit(path)
    (line,) = info.value.lines
    assert line.startswith(f"{path}: {expected}"), line


@pytest.mark.parametrize("defense, expected", [
    ({"name": "soteria", "params": {"layer": "fc9"}},
     "defenses: soteria(layer=fc9): soteria: layer 'fc9' is not a fully connected layer of the model; "
     "choices: largest, 7"),
    ({"name": "precode", "params": {"position": "2"}},
     "defenses: precode(position=2): precode: position '2' is not a fully connected layer of the model; "
     "choices: last, 7"),
])
def test_a_defense_that_does_not_fit_the_model_is_named_before_work(write_audit, capsys, defense, expected):
    path = write_audit(small_audit(defenses=[defense]))
    assert main(["validate", str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"leakaudit: error: {path}: {expected}"


def test_a_setting_with_its_own_model_is_built_with_it(write_audit):
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.scenario import Scenario

    path = write_audit(small_audit(defenses=[{"name": "none"}, {"name": "precode", "params": {"size": 8},
                                                                "model": {"name": "mlp", "params": {"width": 32}}}]))
    audit = load_audit(path)
    assert [s.key for s in audit.settings] == ["none", "precode(size=8)@mlp(width=32)", "none@mlp(width=32)"]
    assert audit.settings[-1].added and audit.reference_of(audit.settings[1]) is audit.settings[-1]
    scenario = Scenario(audit)
    plain = scenario.fresh_model(scenario.defense(audit.settings[0]), audit.settings[0])
    own = scenario.fresh_model(scenario.defense(audit.settings[1]), audit.settings[1])
    assert isinstance(plain[0], nn.Conv2d) and isinstance(own[1], nn.Linear) and own[1].out_features == 32
    again = scenario.fresh_model(scenario.defense(audit.settings[1]), audit.settings[1])
    assert all(torch.equal(a, b) for a, b in zip(own.state_dict().values(), again.state_dict().values()))


def test_bayes_is_refused_where_the_defense_declares_no_likelihood(write_audit, capsys):
    path = write_audit(small_audit(defenses=[{"name": "none"}, {"name": "bayesian", "label": "bnn"}],
                                   attacks=[{"name": "bayes", "params": {"iterations": 5}}]))
    assert main(["validate", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"leakaudit: error: {path}: attacks[0]: on bnn: bayes: defense 'bayesian' declares no log_likelihood "
        "(its noise is drawn inside the model); use the attacks made for it (leakaudit plugins)")
    path = write_audit(small_audit(defenses=[{"name": "none"}, {"name": "bayesian", "label": "bnn"}],
                                   attacks=[{"name": "bayes", "params": {"iterations": 5}, "defenses": ["none"]},
                                            {"name": "bayesian_exact", "params": {"iterations": 5},
                                             "defenses": ["bnn"]}]))
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        f"{path}: valid: 4 attack jobs (2 target batches each): bayes on 1 setting x 1 step (defenses: none); "
        "bayesian_exact on 1 setting x 1 step (defenses: bnn)",
        "  threat models (the least attacker each attack needs, Carletti et al. 2025): bayes: honest-but-curious "
        "server; bayesian_exact: honest-but-curious server"]


@pytest.mark.slow
def test_an_audit_of_all_three_runs_end_to_end_and_reproduces(write_audit, tmp_path):
    import json

    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.runner import run_audit

    ig = {"iterations": 30, "priors": {"tv": 1e-3}}
    audit = load_audit(write_audit(small_audit(
        defenses=[{"name": "soteria", "params": {"fraction": 0.8}}, {"name": "precode", "params": {"size": 16}},
                  {"name": "bayesian", "params": {"layers": "last"}}],
        attacks=[{"name": "inverting_gradients", "label": "ig", "params": ig},
                 {"name": "inverting_gradients", "label": "ig_drop", "defenses": ["soteria"],
                  "params": {**ig, "drop_defended": True}},
                 {"name": "precode_sample", "defenses": ["precode"], "params": ig},
                 {"name": "bayesian_exact", "defenses": ["bayesian"], "params": ig}],
        utility={"train_steps": 3, "batch_size": 2})))
    summary = run_audit(audit, tmp_path / "a", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "a" / "results.jsonl").read_text().splitlines()]
    assert sorted({(r["defense"], r["attack"]) for r in rows}) == [  # the added reference: what can run undefended
        ("bayesian", "bayesian_exact"), ("bayesian", "ig"), ("none", "ig"), ("none", "ig_drop"), ("precode", "ig"),
        ("precode", "precode_sample"), ("soteria", "ig"), ("soteria", "ig_drop")]
    assert {(n.defense, n.naive_attack, n.adaptive_attack) for n in summary.naive_vs_adaptive} == {
        ("none", "ig", "ig_drop"), ("soteria", "ig", "ig_drop"), ("precode", "ig", "precode_sample"),
        ("bayesian", "ig", "bayesian_exact")}
    assert "Naive against adaptive attacks" in (tmp_path / "a" / "report.html").read_text()
    changes = summary.utility
    assert any("variational bottleneck" in c for u in changes.values() for c in u.model_changes)
    run_audit(audit, tmp_path / "b", progress=False)
    again = [json.loads(line) for line in (tmp_path / "b" / "results.jsonl").read_text().splitlines()]
    key = lambda r: (r["setting"], r["attack"], r["target"])  # noqa: E731
    assert [(key(r), r["psnr"]) for r in sorted(rows, key=key)] == [(key(r), r["psnr"]) for r in sorted(again, key=key)]


@pytest.mark.parametrize("section, entry, expected", [
    ("defenses", {"name": "soteria", "params": {"fraction": 1.5}}, "defenses[0].params.fraction: 1.5 is above the maximum 1.0"),
    ("defenses", {"name": "precode", "params": {"size": 0}}, "defenses[0].params.size: 0 is below the minimum 1"),
    ("defenses", {"name": "bayesian", "params": {"init_scale": 0.0}},
     "defenses[0].params.init_scale: 0.0 must be greater than 0.0"),
    ("defenses", {"name": "bayesian", "params": {"share_scales": "no"}},
     "defenses[0].params.share_scales: 'no' is not of type bool"),
    ("attacks", {"name": "bayesian_kl", "params": {"alpha_kl": -1.0}},
     "attacks[0].params.alpha_kl: -1.0 is below the minimum 0.0"),
    ("attacks", {"name": "rgap", "params": {"dense_limit": 0}}, "attacks[0].params.dense_limit: 0 is below the minimum 1"),
    ("attacks", {"name": "rgap", "params": {"cg_iterations": 0}},
     "attacks[0].params.cg_iterations: 0 is below the minimum 1"),
    ("attacks", {"name": "cinet", "params": {"width": 0}}, "attacks[0].params.width: 0 is below the minimum 1"),
    ("attacks", {"name": "cinet", "params": {"latent": 0}}, "attacks[0].params.latent: 0 is below the minimum 1"),
    ("attacks", {"name": "inverting_gradients", "params": {"drop_defended": "yes"}},
     "attacks[0].params.drop_defended: 'yes' is not of type bool"),
])
def test_new_parameters_fail_with_one_line(write_audit, section, entry, expected):
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.audit.types import ConfigError

    path = write_audit(small_audit(**{section: [entry]}))
    with pytest.raises(ConfigError) as info:
        load_audit(path)
    assert info.value.lines == [f"{path}: {expected}"]
