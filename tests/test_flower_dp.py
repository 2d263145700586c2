"""Flower's differential privacy as defenses (defenses/flower.py): the update made by Flower's own functions, the
exact likelihood around the clipped update, the guarantee as configured and its warnings, the extra refused in one
line where Flower is missing. check_defense on each runs in tests/test_checks.py (BUILTIN_SETTINGS)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import flower_train_round
from leakaudit.defenses import flower as flower_defenses
from leakaudit.defenses.flower import FlowerAdaptiveClipping, FlowerFixedClipping, FlowerLocalDp
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.plugins.defense import PrivacyProfile, SharedUpdate
from leakaudit.plugins.manager import param_rows
from leakaudit.plugins.protocol import FEDSGD, FedAvg

pytest.importorskip("flwr")

#: FLIP's Flower defaults (londonaicentre/FLIP #833): the noise's sensitivity far under the clip.
FLIP = {"clipping_norm": 1.0, "sensitivity": 1e-4, "epsilon": 10.0, "delta": 1e-5}


def _update() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]


def test_local_dp_sends_what_flowers_own_functions_send_and_leaves_numpys_generator_alone():
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.supercore.differential_privacy import add_localdp_gaussian_noise_to_params, compute_clip_model_update

    defense, update = FlowerLocalDp(clipping_norm=0.5, sensitivity=0.5, epsilon=2.0, delta=1e-5), _update()
    np.random.seed(11)
    before = np.random.get_state()[1].copy()
    sent = defense.perturb(update, torch.Generator().manual_seed(5))
    assert (np.random.get_state()[1] == before).all()  # the user's NumPy draws are untouched
    arrays = [t.numpy().copy() for t in update]  # Flower by hand, NumPy seeded as the defense seeds it
    compute_clip_model_update(arrays, [np.zeros_like(a) for a in arrays], 0.5)
    np.random.seed(int(torch.randint(0, 2 ** 31 - 1, (1,), generator=torch.Generator().manual_seed(5)).item()))
    expected = parameters_to_ndarrays(add_localdp_gaussian_noise_to_params(ndarrays_to_parameters(arrays), 0.5, 2.0,
                                                                          1e-5))
    assert all(torch.equal(s, torch.from_numpy(e)) for s, e in zip(sent, expected))
    again = defense.perturb(update, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(sent, again))


def test_likelihoods_are_the_gaussian_around_the_clipped_update():
    update, observed = _update(), [torch.zeros(4, 3), torch.ones(5)]
    norm = math.sqrt(sum(float((t ** 2).sum()) for t in update))
    centre = [t * (0.5 / norm) for t in update]
    distance = sum(float(((o - c) ** 2).sum()) for o, c in zip(observed, centre))
    shared = SharedUpdate(observed, ["w", "b"], 1)
    local = FlowerLocalDp(clipping_norm=0.5, sensitivity=0.5, epsilon=2.0, delta=1e-5)
    local_std = 0.5 * math.sqrt(2 * math.log(1.25e5)) / 2.0
    fixed = FlowerFixedClipping(clipping_norm=0.5, noise_multiplier=0.8, num_sampled_clients=10)
    adaptive = FlowerAdaptiveClipping(clipping_norm=0.5, noise_multiplier=0.8, num_sampled_clients=20)
    adaptive_std = 0.5 * (0.8 ** -2 - 2.0 ** -2) ** -0.5  # clipped_count_stddev 20 / 20 = 1
    for defense, std in ((local, local_std), (fixed, 0.4), (adaptive, adaptive_std)):
        assert defense.noise_std() == pytest.approx(std, rel=1e-12)
        assert float(defense.log_likelihood(shared, update)) == pytest.approx(-distance / (2 * std ** 2), rel=1e-5)


def test_adaptive_noise_is_flowers_split_and_a_bad_count_noise_is_one_line():
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    defense = FlowerAdaptiveClipping(clipping_norm=0.1, noise_multiplier=0.5, num_sampled_clients=40,
                                     clipped_count_stddev=3.0)
    assert defense.update_multiplier() == pytest.approx(compute_adaptive_noise_params(0.5, 40, 3.0)[1], rel=1e-12)
    with pytest.raises(ValueError) as exc:
        FlowerAdaptiveClipping(noise_multiplier=2.0, num_sampled_clients=20)  # the count's std: 20 / 20 = 1
    assert str(exc.value) == ("flower_adaptive_clipping: noise_multiplier 2 needs clipped_count_stddev above 1 (it "
                              "is 1); raise clipped_count_stddev or lower noise_multiplier")


def test_epsilon_of_a_gdp_profile_is_opacus_at_moderate_mu_and_finite_far_past_it():
    from opacus.accountants.analysis.gdp import eps_from_mu

    for mu in (0.5, 1.0, 3.0):
        assert PrivacyProfile(mu=mu).epsilon(1e-5) == pytest.approx(eps_from_mu(mu=mu, delta=1e-5), rel=1e-9)
    assert PrivacyProfile(mu=1.0).epsilon(1e-5, releases=9) == pytest.approx(eps_from_mu(mu=3.0, delta=1e-5),
                                                                             rel=1e-9)
    fixed = FlowerFixedClipping(clipping_norm=1.0, noise_multiplier=1.0, num_sampled_clients=10)
    assert fixed.privacy_spent(4, 1.0, 1e-5) == pytest.approx(eps_from_mu(mu=2.0, delta=1e-5), rel=1e-9)
    assert fixed.privacy_spent(0, 1.0, 1e-5) == 0.0  # no round run, nothing spent
    huge = PrivacyProfile(mu=2e4).epsilon(1e-5)
    assert 2e8 < huge < 2.01e8  # about mu^2 / 2: Opacus's bracket [0, 500] cannot hold it


def test_flips_defaults_are_warned_of_in_the_report_text():
    defense = FlowerLocalDp(**FLIP, rounds=5)
    std = 1e-4 * math.sqrt(2 * math.log(1.25e5)) / 10.0
    assert defense.noise_std() == pytest.approx(std, rel=1e-12) and 4.8e-5 < std < 4.9e-5
    profile = defense.privacy_profile()
    assert profile.mu == pytest.approx(1 / std, rel=1e-12)
    text = profile.mechanism
    assert f"noise std {std:.3g} is {1 / std:.3g} times under the clipped update's norm 1" in text
    per_round = PrivacyProfile(mu=1 / std).epsilon(1e-5)
    assert f"epsilon {per_round:.3g} per round" in text and "past any meaningful range" in text
    assert "over 5 rounds" in text and "the configured epsilon 10 is not what a round spends" in text
    calm = FlowerFixedClipping(clipping_norm=1.0, noise_multiplier=1.0, num_sampled_clients=10).privacy_profile()
    assert "WARNING" not in calm.mechanism and calm.mu == 1.0


def test_knobs_are_declared_and_refusals_are_one_line(monkeypatch):
    rows = {r["name"]: r["protects"] for r in param_rows(FlowerLocalDp.params)}
    assert rows["epsilon"] == "lower" and FlowerFixedClipping.params["noise_multiplier"].protects == "higher"
    assert FlowerAdaptiveClipping.params["noise_multiplier"].protects == "higher"
    local = FlowerLocalDp(**FLIP)
    assert local.unsupported(FEDSGD) is None
    assert local.unsupported(FedAvg(clients=4)) == ("flower_local_dp clips one client's update; with clients: 4 the "
                                                    "protocol would clip their mean: use clients: 1")
    monkeypatch.setattr(flower_defenses, "find_spec", lambda name: None)
    assert local.unsupported(FEDSGD) == "flower_local_dp needs Flower: pip install 'leakaudit[flower]'"


def test_auto_chooses_bayes_and_a_missing_flower_is_one_line_before_any_work(write_audit, monkeypatch):
    audit = {"name": "flower", "seed": 0, "device": "cpu",
             "data": {"dataset": "digits", "image_size": 8, "targets": 2, "batch_size": 1},
             "model": {"name": "mlp", "checkpoints": [0]}, "protocol": {"name": "fedavg"},
             "defenses": [{"name": "flower_local_dp", "params": {**FLIP, "sensitivity": 1.0}}],
             "metrics": ["psnr"]}
    loaded = load_audit(write_audit(audit))
    bayes = next(a for a in loaded.attacks if a.name == "bayes")
    assert bayes.applies_to(next(s for s in loaded.settings if not s.added))
    monkeypatch.setattr(flower_defenses, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as exc:
        load_audit(write_audit(audit))
    assert "flower_local_dp needs Flower: pip install 'leakaudit[flower]'" in str(exc.value)


FLOWER_APP = Path(__file__).parents[1] / "examples" / "own_training" / "flower_app"


def test_a_local_dp_mod_inside_leakauditmod_is_the_audited_defense(tmp_path, monkeypatch):
    """LocalDpMod run inside LeakAuditMod: the reply is the mod's (clipped), the round audited is the app's clean
    update under flower_local_dp with the mod's settings; a mod leakaudit cannot read is one line."""
    from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod

    for name, value in (("FLOWER_APP_IMAGES", 40), ("FLOWER_APP_ITERATIONS", 5), ("FLOWER_APP_RUNS", tmp_path)):
        monkeypatch.setenv(name, str(value))
    monkeypatch.syspath_prepend(str(FLOWER_APP))
    for module in ("task", "client_app", "server_app"):
        sys.modules.pop(module, None)
    import client_app
    from task import Net

    from leakaudit.flower import LeakAuditMod

    audit = {**client_app.AUDIT, "attacks": [{"name": "inverting_gradients", "params": {"iterations": 5}}]}
    with pytest.raises(ConfigError) as info:
        LeakAuditMod(Net, mods=[fixedclipping_mod], **audit)
    assert info.value.lines == ["LeakAuditMod: mods[0]: leakaudit cannot see what fixedclipping_mod does to the "
                                "update (the defenses that read a framework's mechanism: flower_adaptive_clipping, "
                                "flower_fixed_clipping, flower_local_dp); leave it out of mods"]
    dp = LocalDpMod(clipping_norm=1e-3, sensitivity=0.0, epsilon=1.0, delta=1e-5)  # no noise: the clip shows exactly
    mod = LeakAuditMod(Net, mods=[dp], **audit)
    start = Net()
    reply = mod(*flower_train_round(monkeypatch, start.state_dict(), 1), client_app.train)
    returned = reply.content["arrays"].to_torch_state_dict()
    sent = [start.state_dict()[n] - returned[n] for n, _ in start.named_parameters()]
    clean = mod.monitors["0"].last_update
    norm = float(torch.sqrt(sum((u ** 2).sum() for u in clean)))
    assert norm > 2e-3 and float(torch.sqrt(sum((s ** 2).sum() for s in sent))) == pytest.approx(1e-3, rel=1e-3)
    assert all(torch.allclose(s, u * (1e-3 / norm), atol=1e-7) for s, u in zip(sent, clean))
    described = json.loads((tmp_path / "clients" / "client-0" / "monitor.json").read_text())
    assert described["defense"] == {"name": "flower_local_dp", "params": {
        "clipping_norm": 1e-3, "sensitivity": 0.0, "epsilon": 1.0, "delta": 1e-5}}
    summary = json.loads((tmp_path / "clients" / "client-0" / "summary.json").read_text())
    privacy = next(w["privacy"] for w in summary["worst_case"] if w["setting"].startswith("flower_local_dp"))
    assert privacy["mechanism"].startswith("Flower LocalDpMod: clip 0.001, noise std 0 ") and privacy["mu"] == float("inf")
    assert "WARNING: no noise: no guarantee" in privacy["mechanism"]
    noisy = LeakAuditMod(Net, mods=[LocalDpMod(clipping_norm=1.0, sensitivity=1.0, epsilon=2.0, delta=1e-5)],
                         **{**audit, "out": tmp_path / "noisy"})
    for server_round in (1, 2):  # a client that takes part in two rounds: its guarantee composed over both
        noisy(*flower_train_round(monkeypatch, start.state_dict(), server_round), client_app.train)
    assert json.loads((tmp_path / "noisy" / "client-0" / "monitor.json").read_text())["fits"] == 2
    worst = next(w for w in noisy.monitors["0"].report().worst_case if w.defense == "flower_local_dp")
    per_round = FlowerLocalDp(clipping_norm=1.0, sensitivity=1.0, epsilon=2.0, delta=1e-5).privacy_profile()
    twice = PrivacyProfile(mu=per_round.mu).epsilon(1e-5, 2)
    assert worst.epsilon == pytest.approx(twice, rel=1e-9) and 1.5 < twice < 2.5
    assert f"{twice:.3g} over 2 rounds (delta 1e-05)" in worst.privacy.mechanism


def _accountant(population: int, method: str = "no-amplification", releases: int = 3):
    """Flower's own RdpAccountant given ``population``, after ``releases`` rounds of noise multiplier 1 over 2."""
    pytest.importorskip("dp_accounting")  # Flower's RdpAccountant: pip install 'flwr[dp]'
    from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod

    relation = "replace-one" if method == "without-replacement" else "add-or-remove-one"
    accountant = RdpAccountant(PrivacyConfig(target_delta=1e-5, population_size=population, neighboring_relation=(
        NeighboringRelation(relation)), sampling_method=SamplingMethod(method)))
    accountant.compose(GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=2, population_size=population), releases)
    return accountant


def test_flowers_accountant_is_read_beside_leakaudits_own_and_its_mismatches_are_one_line_each():
    """The claim of Flower's accountant over its releases beside leakaudit's exact GDP composition of the same; a
    population or sample size the strategy did not use, Poisson sampling, and a claim under the client's own spend
    (amplification the attacked client does not get) are flagged."""
    fixed = FlowerFixedClipping(clipping_norm=1.0, noise_multiplier=1.0, num_sampled_clients=2)
    own = PrivacyProfile(mu=1.0).epsilon(1e-5, 3)
    right = flower_defenses.accountant_reading(_accountant(4), fixed, 2, [4, 4, 4], [2, 2, 2])
    assert len(right) == 1 and right[0].startswith(
        "Flower's accountant (rdp, no-amplification, population_size 4) claims epsilon ")
    claimed = float(right[0].split("claims epsilon ")[1].split()[0])
    assert claimed > own and f"leakaudit's own accounting of the same releases: epsilon {own:.4g}" in right[0]
    wrong = flower_defenses.accountant_reading(_accountant(1000), fixed, 2, [4, 4, 4], [2, 3, 2])
    assert wrong[1:] == [
        "MISMATCH: the accountant's population_size 1000 is not the 4 nodes the strategy samples from: an epsilon "
        "amplified by sampling would be wrong",
        "MISMATCH: the strategy sampled 3 clients in a round, while its noise and the accountant's events assume "
        "num_sampled_clients 2"]
    amplified = flower_defenses.accountant_reading(_accountant(1000, "poisson"), fixed, 2, [1000], [2])
    assert amplified[1] == ("MISMATCH: the accountant credits Poisson sampling; Flower's strategies sample a fixed "
                            "number of nodes without replacement")
    assert amplified[2].startswith("MISMATCH: the accountant's epsilon ") and f"below the {own:.4g} a client's own " \
        "update spends" in amplified[2]
    assert flower_defenses.flower_accountant(fixed) is None  # a leakaudit defense is no Flower strategy


class _BatchNormNet(torch.nn.Module):
    """A small network with BatchNorm: its state holds num_batches_tracked, an int64 array."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                        torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _batchnorm_update() -> list[torch.Tensor]:
    """A BatchNorm model's whole state change over one SGD step, as Flower's arrays carry it (num_batches_tracked's
    change an int64 -1)."""
    net = _BatchNormNet()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 1, 8, 8, generator=g), torch.tensor([0, 1, 2, 0])
    torch.nn.functional.cross_entropy(net(x), y).backward()
    torch.optim.SGD(net.parameters(), lr=0.5).step()
    net(x)  # the running statistics move again, as a second batch would move them
    return [before[k] - v for k, v in net.state_dict().items()]


def test_flowers_dp_reaches_floating_point_arrays_only_as_flower_145_applies_it():
    """A BatchNorm model's update: each flower_* defense clips and noises its floating-point arrays exactly as it
    does them alone (the integer one out of the norm and the draws) and sends num_batches_tracked as it is."""
    update = _batchnorm_update()
    integer = [i for i, t in enumerate(update) if not t.is_floating_point()]
    assert [update[i].dtype for i in integer] == [torch.int64] and int(update[integer[0]]) == -2
    floats = [t for t in update if t.is_floating_point()]
    for defense in (FlowerLocalDp(clipping_norm=0.1, sensitivity=0.1, epsilon=2.0, delta=1e-5),
                    FlowerFixedClipping(clipping_norm=0.1, noise_multiplier=0.5, num_sampled_clients=4),
                    FlowerAdaptiveClipping(clipping_norm=0.1, noise_multiplier=0.5, num_sampled_clients=40)):
        sent = defense.perturb(update, torch.Generator().manual_seed(5))
        alone = defense.perturb(floats, torch.Generator().manual_seed(5))
        assert torch.equal(sent[integer[0]], update[integer[0]]) and sent[integer[0]].dtype == torch.int64
        assert all(torch.equal(s, a) for s, a in zip((t for t in sent if t.is_floating_point()), alone))
        shared = SharedUpdate(sent, [str(i) for i in range(len(sent))], 4)
        assert float(defense.log_likelihood(shared, update)) == pytest.approx(
            float(defense.log_likelihood(SharedUpdate(alone, ["f"] * len(alone), 4), floats)), rel=1e-6)
    if not flower_defenses.flower_float_only():  # this Flower counts the integer array in the norm it clips to
        from flwr.supercore.differential_privacy import compute_clip_model_update

        arrays = [t.numpy().copy() for t in update]
        compute_clip_model_update(arrays, [np.zeros_like(a) for a in arrays], 0.1)
        norm = math.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in arrays if a.dtype.kind == "f"))
        whole = math.sqrt(sum(float((t.double() ** 2).sum()) for t in floats))
        assert norm == pytest.approx(0.1 * whole / math.sqrt(whole ** 2 + 4), rel=1e-5)  # the steps' -2 counted


def test_a_flower_that_clips_integer_arrays_is_refused_in_one_line_on_a_batchnorm_model(monkeypatch):
    from flwr.clientapp.mod import LocalDpMod

    from leakaudit.flower import LeakAuditMod

    audit = {"attacks": [{"name": "inverting_gradients", "params": {"iterations": 5}}], "mean": 0.5, "std": 0.5}
    dp = LocalDpMod(clipping_norm=1.0, sensitivity=1.0, epsilon=1.0, delta=1e-5)
    monkeypatch.setattr(flower_defenses, "flower_float_only", lambda: False)
    with pytest.raises(ConfigError) as info:
        LeakAuditMod(_BatchNormNet, mods=[dp], **audit)
    from importlib.metadata import version

    assert info.value.lines == [f"LeakAuditMod: mods: Flower {version('flwr')} counts the model's integer arrays "
                                "(body.1.num_batches_tracked: the local steps taken) in the norm it clips the update "
                                "to, so the update leaves clipped tighter than clipping_norm, which leakaudit does not "
                                "mirror; audit it with a Flower that applies DP to floating-point arrays only (1.45): "
                                "pip install -U flwr"]
    monkeypatch.setattr(flower_defenses, "flower_float_only", lambda: True)
    LeakAuditMod(_BatchNormNet, mods=[dp], **audit)  # a Flower that leaves them alone: audited
