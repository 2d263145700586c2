"""FedLeak (Fan et al. 2025): partial matching keeps exactly its share of each tensor's largest elements, the
finite-difference regularizer follows the double backward it replaces, and with neither change it is
inverting_gradients bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leakaudit.attacks.fedleak import STEP, FedLeak, kept_count, largest_mask, regularised
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.defenses.noise import NoDefense
from leakaudit.plugins.attack import HONEST_SERVER, Problem, ThreatModel
from leakaudit.plugins.defense import cosine_distance
from leakaudit.plugins.protocol import FEDSGD, ClientStep


def case(dtype: torch.dtype = torch.float32, conv: bool = True):
    """A tiny smooth model (tanh), two 8 px images with their labels, the threat and the observed update."""
    torch.manual_seed(0)
    model = (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 8 * 8, 4)) if conv
             else nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 6), nn.Tanh(), nn.Linear(6, 4))).to(dtype)
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(2, 3, 8, 8, generator=g).to(dtype), torch.tensor([0, 1])
    mean, std = torch.zeros(3, 1, 1, dtype=dtype), torch.ones(3, 1, 1, dtype=dtype)
    threat = ThreatModel(model, F.cross_entropy, (3, 8, 8), mean, std, 4, 2, NoDefense(), labels=y)
    observed = NoDefense().share(ClientStep(model, F.cross_entropy, x, y, torch.Generator().manual_seed(2), FEDSGD))
    return threat, observed


@pytest.mark.parametrize("partial, n, k", [(0.5, 10, 5), (0.5, 7, 4), (0.3, 10, 3), (0.01, 10, 1), (1.0, 9, 9),
                                           (0.25, 4 * 3 * 3 * 3, 27)])
def test_the_mask_keeps_exactly_ceil_partial_n_largest_elements(partial, n, k):
    assert kept_count(partial, n) == k
    values = torch.randn(n, generator=torch.Generator().manual_seed(n))
    values[:2] = values[0]  # a tie still keeps exactly k
    mask = largest_mask(values, partial)
    assert set(mask.unique().tolist()) <= {0.0, 1.0} and int(mask.sum()) == k
    if k < n:
        assert values.abs()[mask == 1].min() >= values.abs()[mask == 0].max()


def test_the_mask_is_per_tensor_and_keeps_its_shape():
    _, observed = case()
    for tensor in observed.tensors:
        mask = largest_mask(tensor, 0.5)
        assert mask.shape == tensor.shape and int(mask.sum()) == kept_count(0.5, tensor.numel())


def test_with_neither_change_it_is_inverting_gradients_bit_for_bit():
    threat, observed = case()
    mine, theirs = FedLeak(iterations=6, partial=1.0, gradient_regularization=0.0), InvertingGradients(iterations=6)
    a, b = mine(observed, threat, torch.Generator().manual_seed(3)), theirs(observed, threat, torch.Generator().manual_seed(3))
    assert torch.equal(a.images, b.images) and a.loss_trace == b.loss_trace and a.extras == b.extras
    together = [FedLeak.reconstruct_all([Problem(observed, threat, torch.Generator().manual_seed(3), attack)
                                         for _ in range(2)], max_problems=2) for attack in (mine, theirs)]
    for x, y in zip(*together):
        assert torch.equal(x.images, y.images) and x.loss_trace == y.loss_trace


def test_the_finite_difference_follows_the_double_backward():
    """Value and gradient of match + rho ||grad match||^2 against autograd's third backward on a smooth MLP, in float64:
    at the default step (1e-2) the penalty's gradient is within 1% of the exact one, its value within 0.1%."""
    threat, observed = case(torch.float64, conv=False)
    labels = threat.labels

    def match(x):
        return cosine_distance(observed.tensors, threat.candidate_update(x, labels))

    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    images.requires_grad_(True)
    rho = 1.0
    loss = match(images)
    g = torch.autograd.grad(loss, images, create_graph=True)[0]
    penalty = g.square().sum()
    exact_penalty_grad = torch.autograd.grad(penalty, images, retain_graph=True)[0]
    g = g.detach()
    approx = regularised(match, images, rho, STEP)
    approx_grad = torch.autograd.grad(approx, images)[0]
    assert (approx - loss).item() == pytest.approx(rho * penalty.item(), rel=1e-3)
    assert torch.linalg.vector_norm(approx_grad - g - rho * exact_penalty_grad) \
        <= 1e-2 * torch.linalg.vector_norm(rho * exact_penalty_grad)
    assert torch.linalg.vector_norm(rho * exact_penalty_grad) > 1e-2 * torch.linalg.vector_norm(g)  # it matters here


def test_one_problem_and_batched_paths_agree_with_both_changes():
    threat, observed = case()
    attack = FedLeak(iterations=5, partial=0.5, gradient_regularization=1e-1)
    alone = attack(observed, threat, torch.Generator().manual_seed(3))
    together = FedLeak.reconstruct_all([Problem(observed, threat, torch.Generator().manual_seed(3), attack)
                                        for _ in range(2)], max_problems=2)
    plain = InvertingGradients(iterations=5)(observed, threat, torch.Generator().manual_seed(3))
    assert not torch.allclose(alone.images, plain.images)  # the changes change the path
    for rec in together:
        assert torch.allclose(rec.images, alone.images, atol=1e-5)
        assert rec.extras["match_loss"] == pytest.approx(alone.extras["match_loss"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("params, message", [
    ({"partial": 0.0}, "fedleak.partial: 0.0 must be greater than 0.0"),
    ({"partial": 1.5}, "fedleak.partial: 1.5 is above the maximum 1.0"),
    ({"gradient_regularization": -1e-3}, "fedleak.gradient_regularization: -0.001 is below the minimum 0.0"),
])
def test_bad_params_are_one_line(params, message):
    with pytest.raises(ValueError) as exc:
        FedLeak(**params)
    assert str(exc.value) == message and "\n" not in str(exc.value)


def test_registered_at_the_honest_server_and_left_out_of_auto(registry):
    assert registry.get("attack", "fedleak") is FedLeak
    assert FedLeak.attacker == HONEST_SERVER and FedLeak.paper == "Fan et al. 2025"
    assert FedLeak.auto_settings("cpu") is None and "docs/results.md" in FedLeak.auto_skip
