"""A defense's parameter-only loss term (Bayesian layers' KL) enters the attacker's candidate update as a gradient
computed once: the update and its gradient in the images must be what differentiating the whole loss gives."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leakaudit.attacks.vectorised import SharedModel, candidate_update
from leakaudit.defenses.bayesian import Bayesian
from leakaudit.plugins.attack import ThreatModel, parameter_gradient
from leakaudit.plugins.protocol import FEDSGD, FedAvg, trainable
from leakaudit.plugins.stochastic import noise_from
from leakaudit.evaluator.zoo.models import lenet_zhu


def _case(protocol=FEDSGD, kl_weight=0.5):
    defense = Bayesian(kl_weight=kl_weight)
    model = defense.wrap_model(lenet_zhu(1, 10, 16))
    for layer in model.modules():
        if hasattr(layer, "given_noise"):
            layer.given_noise = None
    threat = ThreatModel(model, F.cross_entropy, (1, 16, 16), torch.zeros(1, 1, 1), torch.ones(1, 1, 1), 10, 2,
                         defense, protocol=protocol)
    images = torch.randn(2, 1, 16, 16, requires_grad=True)
    return defense, model, threat, images, torch.tensor([3, 7])


def _whole_loss_update(defense, model, images, labels, seed=0):
    """The update with the KL inside the loss, differentiated as a whole (the reference)."""
    with noise_from(model, torch.Generator().manual_seed(seed)):
        loss = defense.client_loss(model, F.cross_entropy)(model(images), labels)
        return list(torch.autograd.grad(loss, trainable(model), create_graph=True))


def test_hoisted_kl_gives_the_update_and_image_gradient_of_the_whole_loss():
    defense, model, threat, images, labels = _case()
    expected = _whole_loss_update(defense, model, images, labels)
    with noise_from(model, torch.Generator().manual_seed(0)):
        got = threat.candidate_update(images, labels)
    assert threat._hoisted[1] is not None  # the term was hoisted
    for e, g in zip(expected, got):
        assert torch.allclose(e, g, atol=1e-6, rtol=1e-5)
    kl_part = parameter_gradient(model, defense, FEDSGD)
    assert max(float(k.abs().max()) for k in kl_part) > 1e-3  # the KL moves the update: the test can tell
    target = [e.detach() + 0.1 for e in expected]
    ref = torch.autograd.grad(sum(((t - e) ** 2).sum() for t, e in zip(target, expected)), images)[0]
    ours = torch.autograd.grad(sum(((t - g) ** 2).sum() for t, g in zip(target, got)), images)[0]
    assert torch.allclose(ref, ours, atol=1e-6, rtol=1e-5)


def test_the_hoisted_gradient_follows_the_weights_and_stays_inside_under_fedavg():
    defense, model, threat, images, labels = _case()
    with noise_from(model, torch.Generator().manual_seed(0)):
        threat.candidate_update(images, labels)
    before = [h.clone() for h in threat._hoisted[1]]
    with torch.no_grad():
        next(iter(trainable(model))).mul_(3.0)  # an optimiser step between rounds: the KL's gradient changes
    with noise_from(model, torch.Generator().manual_seed(0)):
        got = threat.candidate_update(images, labels)
    expected = _whole_loss_update(defense, model, images, labels)
    assert not torch.allclose(before[0], threat._hoisted[1][0])
    assert all(torch.allclose(e, g, atol=1e-6, rtol=1e-5) for e, g in zip(expected, got))
    assert parameter_gradient(model, defense, FedAvg(local_epochs=2)) is None  # later local steps see other weights
    assert parameter_gradient(model, Bayesian(kl_weight=0.0), FEDSGD) is None
    for p in model.parameters():
        p.requires_grad_(False)
    assert parameter_gradient(model, defense, FEDSGD) is None  # a KL of frozen layers only: nothing to hoist


@pytest.mark.parametrize("kl_weight", [0.5, 0.0])
def test_the_vectorised_update_hoists_as_the_threat_model_does(kl_weight):
    defense, model, threat, images, labels = _case(kl_weight=kl_weight)
    noise = {}
    for name, layer in model.named_modules():
        if hasattr(layer, "noise_shapes"):
            noise[name] = [torch.randn(s) for s in layer.noise_shapes(2)]
            layer.given_noise = noise[name]
    shared = SharedModel.of(model, threat)
    assert (shared.hoisted is None) == (kl_weight == 0)
    got = candidate_update(shared, threat, images, labels)
    expected = _whole_loss_update(defense, model, images, labels)
    assert all(torch.allclose(e, g, atol=1e-6, rtol=1e-5) for e, g in zip(expected, got))
