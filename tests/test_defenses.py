"""Defenses sample what their likelihood claims, and the likelihood prefers the true input."""
from __future__ import annotations

import pytest
import torch

from leakaudit.defenses.noise import GaussianNoise, NoDefense
from leakaudit.evaluator.run.scenario import loss_fn
from leakaudit.evaluator.zoo.models import lenet_zhu
from leakaudit.plugins.protocol import ClientStep, fedsgd_update


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


from leakaudit.defenses.chain import Chain  # noqa: E402
from leakaudit.defenses.clipping import Clip  # noqa: E402
from leakaudit.defenses.noise import LaplaceNoise  # noqa: E402
from leakaudit.defenses.pruning import RandomPrune, TopK  # noqa: E402


def _noise(defense, step):
    clean = step.clean_update()
    shared = defense.share(step)
    return torch.cat([(s - c).flatten() for s, c in zip(shared.tensors, clean)]), shared, clean


def test_laplace_noise_statistics_and_likelihood():
    step, model = _step()
    noise, shared, _ = _noise(LaplaceNoise(scale=0.2), step)
    assert noise.mean().item() == pytest.approx(0.0, abs=0.02)
    assert noise.abs().mean().item() == pytest.approx(0.2, rel=0.03)  # E|X| = b
    assert noise.std().item() == pytest.approx(0.2 * 2 ** 0.5, rel=0.05)
    exact = torch.distributions.Laplace(0.0, 0.2)
    a = [torch.zeros_like(t) for t in shared.tensors]
    b = [torch.full_like(t, 0.3) for t in shared.tensors]
    diff = exact.log_prob(shared.flat()).sum() - exact.log_prob(shared.flat() - 0.3).sum()
    ll = LaplaceNoise(scale=0.2)
    assert (ll.log_likelihood(shared, a) - ll.log_likelihood(shared, b)).item() == pytest.approx(diff.item(), rel=1e-4)


def test_prune_zeroes_the_claimed_fraction_and_keeps_the_rest_exact():
    step, _ = _step()
    shared = RandomPrune(fraction=0.3).share(step)
    clean = torch.cat([c.flatten() for c in step.clean_update()])
    sent = shared.flat()
    zero = (sent == 0) & (clean != 0)
    assert zero.float().mean().item() == pytest.approx(0.3, abs=0.02)
    assert torch.equal(sent[~zero], clean[~zero])
    assert "keep_mask" not in shared.metadata


def test_prune_mask_per_round_or_fixed_and_known_only_when_said():
    def mask(defense, seed):
        step, _ = _step()
        step.generator.manual_seed(seed)
        return torch.cat([m.flatten() for m in defense.share(step).metadata["keep_mask"]])
    per_round = RandomPrune(fraction=0.5, attacker_knows_mask=True)
    fixed = RandomPrune(fraction=0.5, mask="fixed", attacker_knows_mask=True)
    assert not torch.equal(mask(per_round, 1), mask(per_round, 2))
    assert torch.equal(mask(fixed, 1), mask(fixed, 2))


def test_prune_with_noise_likelihood_is_the_exact_mixture():
    step, _ = _step()
    defense = RandomPrune(fraction=0.25, noise="gaussian", scale=0.1)
    shared = defense.share(step)
    cand = [torch.full_like(t, 0.05) for t in shared.tensors]
    o = shared.flat()
    n0, n1 = torch.distributions.Normal(0.0, 0.1), torch.distributions.Normal(0.05, 0.1)
    mix = torch.logaddexp(torch.log(torch.tensor(0.25)) + n0.log_prob(o), torch.log(torch.tensor(0.75)) + n1.log_prob(o))
    const = o.numel() * (torch.log(torch.tensor(0.1)) + 0.5 * torch.log(torch.tensor(2 * torch.pi)))
    assert defense.log_likelihood(shared, cand).item() == pytest.approx((mix.sum() + const).item(), rel=1e-5)
    step, _ = _step()
    known = RandomPrune(fraction=0.25, noise="gaussian", scale=0.1, attacker_knows_mask=True).share(step)
    keep = torch.cat([m.flatten() for m in known.metadata["keep_mask"]])
    noise = known.flat() - keep * torch.cat([c.flatten() for c in step.clean_update()])
    assert keep.float().mean().item() == pytest.approx(0.75, abs=0.02)
    assert noise.std().item() == pytest.approx(0.1, rel=0.03) and noise.mean().item() == pytest.approx(0, abs=0.005)


def test_topk_keeps_the_largest_fraction_per_tensor():
    step, _ = _step()
    shared = TopK(fraction=0.1).share(step)
    for sent, clean in zip(shared.tensors, step.clean_update()):
        kept = sent != 0
        assert kept.sum().item() == max(1, -(-clean.numel() // 10))
        assert sent[kept].abs().min() >= clean[~kept].abs().max()


def test_clip_bounds_the_total_norm():
    step, _ = _step()
    clean_norm = torch.cat([c.flatten() for c in step.clean_update()]).norm().item()
    shared = Clip(max_norm=clean_norm / 4).share(step)
    assert shared.flat().norm().item() == pytest.approx(clean_norm / 4, rel=1e-5)
    assert torch.equal(Clip(max_norm=clean_norm * 2).share(step).flat(),
                       torch.cat([c.flatten() for c in step.clean_update()]))


def test_chain_applies_in_order_and_its_likelihood_is_the_last_members():
    step, _ = _step()
    chain = Chain([Clip(max_norm=0.01), GaussianNoise(sigma=1e-6)])
    shared = chain.share(step)
    assert shared.flat().norm().item() == pytest.approx(0.01, rel=0.02)
    cand = step.clean_update()
    expected = GaussianNoise(sigma=1e-6).log_likelihood(shared, Clip(max_norm=0.01).transform(cand))
    assert chain.log_likelihood(shared, cand).item() == pytest.approx(expected.item())
    with pytest.raises(ValueError, match="only the last member may be random; 'gaussian' at position 0 is random"):
        Chain([GaussianNoise(sigma=0.1), Clip(max_norm=1.0)])


@pytest.mark.parametrize("defense", [
    LaplaceNoise(scale=0.01), RandomPrune(fraction=0.5), RandomPrune(fraction=0.5, noise="laplace", scale=0.01),
    RandomPrune(fraction=0.5, noise="gaussian", scale=0.01, attacker_knows_mask=True), TopK(fraction=0.2),
    Clip(max_norm=0.5), Chain([Clip(max_norm=0.5), GaussianNoise(sigma=0.01)])], ids=repr)
def test_every_defense_prefers_the_true_input(defense):
    step, model = _step()
    shared = defense.share(step)
    true = fedsgd_update(model, loss_fn, step.inputs, step.labels)
    for seed in range(3):
        torch.manual_seed(100 + seed)
        other = fedsgd_update(model, loss_fn, torch.rand(1, 1, 16, 16), step.labels)
        assert defense.log_likelihood(shared, true) > defense.log_likelihood(shared, other)


def test_prune_noise_needs_a_scale():
    with pytest.raises(ValueError, match="noise 'gaussian' needs scale > 0"):
        RandomPrune(noise="gaussian")
