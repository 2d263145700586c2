"""leakaudit.testing's checks for plugin authors: check_defense (share() against log_likelihood()) and
check_attack (an undefended image, every protocol an attack does not refuse)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from leakaudit import Attack, Defense, DeterministicDefense, Param, Reconstruction
from leakaudit.defenses.chain import Chain
from leakaudit.defenses.noise import gaussian_log_density, laplace_log_density, sample_gaussian
from leakaudit.testing import check_attack, check_defense, tiny_case

from conftest import small_audit

#: Every built-in defense, configured where it needs parameters, with the kind of check it gets.
BUILTIN_SETTINGS = {
    "none": ({}, "exact"),
    "clip": ({"max_norm": 0.5}, "exact"),
    "topk": ({}, "exact"),
    "prune": ({}, "exact"),  # no noise: the mask shows in the exact zeros
    "soteria": ({}, "exact"),
    "ats": ({}, "exact"),
    "signsgd": ({}, "exact"),
    "gaussian": ({"sigma": 0.1}, "noisy"),
    "laplace": ({"scale": 0.05}, "noisy"),
    "qsgd": ({}, "noisy"),  # by autograd: its triangles' support is bounded
    "dpsgd": ({}, "noisy"),
    "precode": ({}, "no likelihood"),
    "bayesian": ({}, "no likelihood"),
    "frozen_embeddings": ({}, "exact"),  # a text defense: checked on a small causal transformer's sentences
    "lora": ({"rank": 4}, "exact"),
    # Flower's mechanisms, computed by Flower (leakaudit[flower]): the noise a tenth of the clip, which is under
    # the tiny case's update norm (1.8), so the clip is active
    "flower_local_dp": ({"clipping_norm": 0.5, "sensitivity": 0.5, "epsilon": 10.0, "delta": 1e-5}, "noisy"),
    "flower_fixed_clipping": ({"clipping_norm": 0.5, "noise_multiplier": 0.1, "num_sampled_clients": 4}, "noisy"),
    "flower_adaptive_clipping": ({"clipping_norm": 0.5, "noise_multiplier": 0.1, "num_sampled_clients": 20}, "noisy"),
    # FLARE's filters, computed by FLARE (leakaudit[nvflare]): gamma 0.1 clips some of the tiny case's coordinates
    "nvflare_percentile": ({"percentile": 30.0, "gamma": 0.1}, "exact"),
    "nvflare_exclude_vars": ({"exclude_vars": ["3.weight"]}, "exact"),
    # half the coordinates sent, none clipped, Laplace(2 gamma / noise_var = 0.1) on each
    "nvflare_svt": ({"fraction": 0.5, "gamma": 10.0, "noise_var": 200.0}, "noisy"),
    # a job's client configuration whose result filter leaves the tiny case's last layer out
    "nvflare_job": ({"path": str(Path(__file__).parent / "data" / "nvflare_config_fed_client.json")}, "exact"),
}


def _case(defense) -> tuple:
    """The model and batch the check runs on: tiny_case's images, or two PII sentences for a text-only defense."""
    if "image" in defense.modalities:
        return None, None
    from leakaudit.evaluator.zoo.text import TinyTransformer, load_pii_sentences

    data = load_pii_sentences(length=16, train=8, test=4)
    torch.manual_seed(0)
    return TinyTransformer(data.vocab_size, data.num_classes, 16, width=32, layers=2), (data.test_x[:2], data.test_y[:2])


def test_every_builtin_defense_is_covered(registry):
    builtin = {n for n in registry.names("defense") if registry.entries["defense"][n].origin.startswith("builtin:")}
    assert builtin == set(BUILTIN_SETTINGS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILTIN_SETTINGS))
def test_builtin_defense_passes(registry, name):
    params, kind = BUILTIN_SETTINGS[name]
    defense = registry.get("defense", name)(**params)
    check = check_defense(defense, *_case(defense))
    assert check.kind == kind and check.shares == 256
    if kind == "noisy":
        assert 0.9 < check.scale_ratio < 1.1 and check.centre_z < 4


@pytest.mark.parametrize("params", [
    {"noise": "gaussian", "scale": 0.05},                                # the mask unknown: a mixture
    {"noise": "laplace", "scale": 0.05, "attacker_knows_mask": True},
])
@pytest.mark.slow
def test_noisy_pruning_passes(registry, params):
    check = check_defense(registry.get("defense", "prune")(**params))
    assert check.kind == "noisy" and 0.9 < check.scale_ratio < 1.1


@pytest.mark.slow
def test_a_chain_passes(registry):
    chain = Chain([registry.get("defense", "clip")(max_norm=0.5), registry.get("defense", "gaussian")(sigma=0.05)])
    assert check_defense(chain).kind == "noisy"


class SendsThreeTimesTheNoise(Defense):
    """Declares Gaussian noise of sigma, sends 3 sigma."""

    name = "wrong_scale"
    params = {"sigma": Param(type=float)}

    def perturb(self, update, generator):
        return [g + sample_gaussian(g, 3 * self.sigma, generator) for g in update]

    def log_likelihood(self, observed, candidate):
        return sum(gaussian_log_density(o - c, self.sigma).sum() for o, c in zip(observed.tensors, candidate))


class DeclaresLaplaceSendsGaussian(Defense):
    """Sends N(0, scale^2) noise, declares Laplace(0, scale)."""

    name = "wrong_family"
    params = {"scale": Param(type=float)}

    def perturb(self, update, generator):
        return [g + sample_gaussian(g, self.scale, generator) for g in update]

    def log_likelihood(self, observed, candidate):
        return sum(laplace_log_density(o - c, self.scale).sum() for o, c in zip(observed.tensors, candidate))


def _ratio(message: str) -> float:
    return float(re.search(r"score variance is ([\d.]+)x", message).group(1))


@pytest.mark.slow
def test_wrong_noise_scale_fails_with_the_ratio():
    with pytest.raises(AssertionError) as info:
        check_defense(SendsThreeTimesTheNoise(sigma=0.1))
    message = str(info.value)
    assert message.startswith("SendsThreeTimesTheNoise(sigma=0.1): log_likelihood is sharper than what share() sends")
    assert 8 < _ratio(message) < 10  # (0.3 / 0.1)^2
    assert "as if the noise sent were 3" in message or "as if the noise sent were 2.9" in message


@pytest.mark.slow
def test_laplace_declared_where_gaussian_is_sent_fails():
    with pytest.raises(AssertionError, match="sharper than what share"):
        check_defense(DeclaresLaplaceSendsGaussian(scale=0.1))


@pytest.mark.slow
def test_the_same_noise_declared_rightly_passes():
    class Right(DeclaresLaplaceSendsGaussian):
        def log_likelihood(self, observed, candidate):
            return sum(gaussian_log_density(o - c, self.scale).sum() for o, c in zip(observed.tensors, candidate))

    assert check_defense(Right(scale=0.1)).kind == "noisy"


@pytest.mark.slow
def test_a_likelihood_centred_off_what_is_sent_fails():
    class Shrunk(SendsThreeTimesTheNoise):
        def perturb(self, update, generator):
            return [g + sample_gaussian(g, self.sigma, generator) for g in update]

        def log_likelihood(self, observed, candidate):
            return sum(gaussian_log_density(o - 0.9 * c, self.sigma).sum() for o, c in zip(observed.tensors, candidate))

    with pytest.raises(AssertionError, match="along the update's own direction has a higher expected log-likelihood"):
        check_defense(Shrunk(sigma=0.1))


def test_noise_from_the_global_generator_fails():
    class GlobalNoise(SendsThreeTimesTheNoise):
        def perturb(self, update, generator):
            return [g + self.sigma * torch.randn_like(g) for g in update]

    with pytest.raises(AssertionError, match="share\\(\\) is not reproducible"):
        check_defense(GlobalNoise(sigma=0.1))


def test_a_random_defense_declared_deterministic_fails():
    class Lying(SendsThreeTimesTheNoise):
        deterministic = True

    with pytest.raises(AssertionError, match="declares deterministic = True"):
        check_defense(Lying(sigma=0.1))


def test_a_likelihood_that_ignores_the_candidate_fails():
    class Blind(DeterministicDefense):
        name = "blind"

        def log_likelihood(self, observed, candidate):
            return sum((c * 0).sum() for c in candidate)

    with pytest.raises(AssertionError, match="ignores the candidate"):
        check_defense(Blind())


def test_a_likelihood_with_a_data_dependent_branch_fails_where_bayes_vectorises_it():
    """A Python branch on the observed update (as topk's likelihood had) cannot run under vmap: the vectorised
    bayes attack failed on every cell of two or more targets. check_defense runs it as the engine does."""
    class Branching(SendsThreeTimesTheNoise):
        def perturb(self, update, generator):
            return [g + sample_gaussian(g, self.sigma, generator) for g in update]

        def log_likelihood(self, observed, candidate):
            total = 0.0
            for o, c in zip(observed.tensors, candidate):
                if (o != 0).any():
                    total = total + gaussian_log_density(o - c, self.sigma).sum()
            return total

    with pytest.raises(AssertionError, match=r"log_likelihood fails under torch.func.vmap.*with torch.where"):
        check_defense(Branching(sigma=0.1))


def test_bayes_attacks_topk_on_many_targets_at_once(write_audit, tmp_path):
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.runner import run_audit

    audit = small_audit(defenses=[{"name": "topk", "params": {"fraction": 0.5}}], utility={"train_steps": 0},
                        attacks=[{"name": "bayes", "params": {"iterations": 3}}], metrics=["psnr"])
    summary = run_audit(load_audit(write_audit(audit)), tmp_path / "out", progress=False, workers=1)
    cell = summary.cell("topk(fraction=0.5)", "bayes", 0)
    assert cell.targets == 2 and cell.scores["psnr"].n == 2


def test_a_share_missing_a_tensor_fails():
    class Drops(Defense):
        name = "drops"

        def perturb(self, update, generator):
            return update[:-1]

    with pytest.raises(AssertionError, match="sent 3 tensors for the model's 4 trainable parameters"):
        check_defense(Drops())


def test_check_defense_takes_a_configured_defense(registry):
    with pytest.raises(TypeError, match=r"GaussianNoise\(\.\.\.\)"):
        check_defense(registry.get("defense", "gaussian"))


def test_own_model_and_batch(registry):
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    _, x, y = tiny_case(images=3)
    check = check_defense(registry.get("defense", "gaussian")(sigma=0.2), model, (x, y), shares=64, directions=8)
    assert check.shares == 64 and check.directions == 8


@pytest.mark.slow
@pytest.mark.parametrize("name, params", [("inverting_gradients", {"iterations": 200}), ("analytic", {}),
                                          ("bayes", {"iterations": 200})])
def test_builtin_attacks_pass(registry, name, params):
    check = check_attack(registry.get("attack", name)(**params))
    assert check.psnr["fedsgd"] > check.noise_psnr + 10


def test_refusals_are_recorded(registry):
    check = check_attack(registry.get("attack", "analytic")())
    assert set(check.psnr) == {"fedsgd", "step"} and "FedSGD only" in check.refused["fedavg"]


def test_rgap_on_a_tanh_model(registry):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    check = check_attack(registry.get("attack", "rgap")(), model)
    assert check.psnr["fedsgd"] > 30


class Guess(Attack):
    """Returns uniform noise from its generator."""

    name = "guess"

    def reconstruct(self, observed, threat, generator):
        shape = (threat.batch_size, *threat.input_shape)
        images = torch.rand(shape, generator=generator, device=threat.device)
        return Reconstruction(images, torch.zeros(threat.batch_size, dtype=torch.long), [], 0.0)


def test_an_attack_no_better_than_noise_fails():
    with pytest.raises(AssertionError, match=r"Guess\(\): protocol fedsgd: PSNR [\d.]+ dB on an undefended image, "
                                             r"not 1 dB above random noise's"):
        check_attack(Guess())


def test_an_attack_that_fails_on_a_protocol_it_accepts_fails():
    class FedSGDOnly(Guess):
        def reconstruct(self, observed, threat, generator):
            if threat.protocol.name != "fedsgd":
                raise ValueError("cannot unroll local steps")
            return Reconstruction(observed.tensors[0].new_zeros(1, *threat.input_shape) + 0.5,
                                  torch.zeros(1, dtype=torch.long), [], 0.0)

    with pytest.raises(AssertionError, match=r"protocol fedavg: raised ValueError: cannot unroll local steps \(refuse"):
        check_attack(FedSGDOnly())


def test_an_attack_drawing_from_the_global_generator_fails():
    class Unseeded(Guess):
        def reconstruct(self, observed, threat, generator):
            rec = super().reconstruct(observed, threat, generator)
            rec.images = torch.rand_like(rec.images)
            return rec

    with pytest.raises(AssertionError, match="protocol fedsgd: not reproducible"):
        check_attack(Unseeded())


def test_a_likelihood_with_its_minimum_at_the_truth_fails():
    class Upside(SendsThreeTimesTheNoise):
        def log_likelihood(self, observed, candidate):
            return -super().log_likelihood(observed, candidate)

    with pytest.raises(AssertionError, match="not peaked at the true candidate along the update's own direction "
                                             "and 31 more"):
        check_defense(Upside(sigma=0.1))


def test_an_auto_budget_the_attack_refuses_fails():
    class Budgeted(Guess):
        params = {"iterations": Param(10, int, min=1)}
        auto_params = {"cpu": {"iterations": 0}}

    with pytest.raises(AssertionError, match=r"auto_params\['cpu'\]: \{'iterations': 0\} is refused: .*iterations"):
        check_attack(Budgeted())
