"""Defenses sample what their likelihood claims, and the likelihood prefers the true input."""
from __future__ import annotations

import pytest
import torch

from defenses.noise import GaussianNoise, NoDefense
from evaluator.models import lenet_zhu
from evaluator.protocol import ClientStep, fedsgd_update
from evaluator.scenario import loss_fn


def _step(seed: int = 0):
    torch.manual_seed(seed)
    model = lenet_zhu(1, 10, 16)
    x, y = torch.rand(1, 1, 16, 16), torch.tensor([3])
    return ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(seed)), model


def test_none_shares_the_exact_gradient():
    step, model = _step()
    shared = NoDefense().share(step)
    clean = fedsgd_update(model, loss_fn, step.inputs, step.labels)
    assert all(torch.equal(a, b) for a, b in zip(shared.tensors, clean))
    assert shared.batch_size == 1 and len(shared.names) == len(clean)


def test_gaussian_noise_has_the_claimed_statistics():
    step, _ = _step()
    clean = step.clean_update()
    shared = GaussianNoise(sigma=0.3).share(step)
    noise = torch.cat([(s - c).flatten() for s, c in zip(shared.tensors, clean)])
    assert noise.numel() > 5000
    assert noise.mean().item() == pytest.approx(0.0, abs=0.02)
    assert noise.std().item() == pytest.approx(0.3, rel=0.03)


def test_gaussian_likelihood_is_the_exact_log_density_up_to_a_constant():
    step, _ = _step()
    defense = GaussianNoise(sigma=0.5)
    shared = defense.share(step)
    a = [torch.zeros_like(t) for t in shared.tensors]
    b = [torch.ones_like(t) for t in shared.tensors]
    dist = torch.distributions.Normal(torch.cat([t.flatten() for t in a]), 0.5)
    dist_b = torch.distributions.Normal(torch.cat([t.flatten() for t in b]), 0.5)
    obs = shared.flat()
    exact = dist.log_prob(obs).sum() - dist_b.log_prob(obs).sum()
    ours = defense.log_likelihood(shared, a) - defense.log_likelihood(shared, b)
    assert ours.item() == pytest.approx(exact.item(), rel=1e-4)


@pytest.mark.parametrize("defense", [NoDefense(), GaussianNoise(sigma=0.01)])
def test_true_input_is_more_likely_than_another_image(defense):
    step, model = _step()
    shared = defense.share(step)
    true = fedsgd_update(model, loss_fn, step.inputs, step.labels)
    other = fedsgd_update(model, loss_fn, torch.rand(1, 1, 16, 16), step.labels)
    assert defense.log_likelihood(shared, true) > defense.log_likelihood(shared, other)


def test_noise_is_reproducible_from_the_generator():
    s1, _ = _step(4)
    s2, _ = _step(4)
    a, b = GaussianNoise(sigma=0.1).share(s1), GaussianNoise(sigma=0.1).share(s2)
    assert torch.equal(a.flat(), b.flat())


def test_bad_parameter_is_refused():
    with pytest.raises(ValueError, match="gaussian.sigma: -1.0 must be greater than 0.0"):
        GaussianNoise(sigma=-1.0)
