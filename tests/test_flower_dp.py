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
