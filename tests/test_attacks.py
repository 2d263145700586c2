"""Attacks: label recovery exact for one image; Inverting Gradients breaks an undefended LeNet, not a noisy one."""
from __future__ import annotations

import pytest
import torch

from leakaudit.attacks.gradient_matching import InvertingGradients, step_decay_milestones
from leakaudit.attacks.labels import labels_from_signs
from leakaudit.attacks.priors import total_variation
from leakaudit.defenses.noise import GaussianNoise, NoDefense
from leakaudit.evaluator.run.scenario import loss_fn
from leakaudit.evaluator.zoo.datasets import load_digits
from leakaudit.evaluator.zoo.metrics import psnr
from leakaudit.evaluator.zoo.models import lenet_zhu, mlp
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.defense import cosine_distance
from leakaudit.plugins.protocol import FEDSGD, ClientStep, FedAvg


def test_label_from_gradient_signs_is_exact_for_one_image():
    torch.manual_seed(0)
    for build in (lambda: lenet_zhu(1, 10, 16), lambda: mlp(1, 10, 16, width=32)):
        model = build()
        for label in range(10):
            step = ClientStep(model, loss_fn, torch.randn(1, 1, 16, 16), torch.tensor([label]), torch.Generator())
            assert labels_from_signs(NoDefense().share(step), 1).item() == label


def test_label_recovery_for_distinct_labels_in_a_batch():
    torch.manual_seed(1)
    model = lenet_zhu(1, 10, 16)
    labels = torch.tensor([7, 2, 5])
    step = ClientStep(model, loss_fn, torch.randn(3, 1, 16, 16), labels, torch.Generator())
    assert labels_from_signs(NoDefense().share(step), 3).tolist() == [2, 5, 7]


def test_cosine_distance_and_tv_exact():
    a = [torch.tensor([1.0, 0.0]), torch.tensor([0.0])]
    assert cosine_distance(a, [torch.tensor([2.0, 0.0]), torch.tensor([0.0])]).item() == 0.0
    assert cosine_distance(a, [torch.tensor([0.0, 1.0]), torch.tensor([0.0])]).item() == 1.0
    img = torch.zeros(1, 1, 2, 2)
    img[..., 0, 1] = 1.0  # one step right of the top-left pixel
    assert total_variation(img).item() == 0.5 + 0.5
    assert step_decay_milestones(800) == [300, 500, 700]


def _attack_digit(defense, iterations=600):
    data = load_digits(image_size=16)
    torch.manual_seed(0)
    model = lenet_zhu(1, 10, 16)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    pixels, label = data.test_x[:1], data.test_y[:1]
    step = ClientStep(model, loss_fn, (pixels - mean) / std, label, torch.Generator().manual_seed(1))
    observed = defense.share(step)
    threat = ThreatModel(model, loss_fn, (1, 16, 16), mean, std, 10, 1, defense)
    rec = InvertingGradients(iterations=iterations)(observed, threat, torch.Generator().manual_seed(2))
    assert rec.labels.tolist() == label.tolist() and rec.images.shape == pixels.shape
    assert 0 <= rec.images.min() and rec.images.max() <= 1
    assert len(rec.loss_trace) == iterations and rec.loss_trace[-1] < rec.loss_trace[0]
    return psnr(rec.images, pixels).item()


@pytest.mark.slow
def test_inverting_gradients_breaks_undefended_lenet():
    assert _attack_digit(NoDefense()) > 18.0


@pytest.mark.slow
def test_inverting_gradients_fails_under_strong_noise():
    assert _attack_digit(GaussianNoise(sigma=1.0)) < 12.0


def _scenario(model, index=0, size=16, protocol=None):
    from leakaudit.plugins.protocol import FedSGD

    protocol = protocol or FedSGD()
    data = load_digits(image_size=size)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    pixels, label = data.test_x[index:index + 1], data.test_y[index:index + 1]
    step = ClientStep(model, loss_fn, (pixels - mean) / std, label, torch.Generator().manual_seed(1), protocol)
    threat = ThreatModel(model, loss_fn, (1, size, size), mean, std, 10, 1, NoDefense(), protocol=protocol)
    return NoDefense().share(step), threat, pixels, label


@pytest.mark.slow
def test_dlg_with_lbfgs_rebuilds_a_digit_from_untrained_lenet():
    from leakaudit.attacks.gradient_matching import DeepLeakage, ImprovedDeepLeakage

    torch.manual_seed(0)
    observed, threat, pixels, label = _scenario(lenet_zhu(1, 10, 16))
    rec = DeepLeakage(iterations=30, restarts=2)(observed, threat, torch.Generator().manual_seed(0))
    assert psnr(rec.images, pixels).item() > 30.0 and rec.labels.tolist() == label.tolist()
    rec = ImprovedDeepLeakage(iterations=30, restarts=1)(observed, threat, torch.Generator().manual_seed(0))
    assert psnr(rec.images, pixels).item() > 30.0 and rec.labels.tolist() == label.tolist()


def test_analytic_inverts_an_mlp_exactly():
    from leakaudit.attacks.analytic import AnalyticInversion

    torch.manual_seed(0)
    observed, threat, pixels, label = _scenario(mlp(1, 10, 16, width=64))
    rec = AnalyticInversion()(observed, threat, torch.Generator())
    assert psnr(rec.images, pixels).item() > 100.0 and rec.labels.tolist() == label.tolist()


def test_analytic_without_bias_uses_the_next_layer():
    from leakaudit.attacks.analytic import AnalyticInversion

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 64, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    observed, threat, pixels, _ = _scenario(model)
    assert psnr(AnalyticInversion()(observed, threat, torch.Generator()).images, pixels).item() > 100.0


def test_analytic_says_where_it_does_not_apply():
    from leakaudit.attacks.analytic import AnalyticInversion

    assert "must start with a fully connected layer" in AnalyticInversion().unsupported(lenet_zhu(1, 10, 16), 1, FEDSGD)
    assert "exact for one image" in AnalyticInversion().unsupported(mlp(1, 10, 16), 2, FEDSGD)
    assert AnalyticInversion().unsupported(mlp(1, 10, 16), 1, FEDSGD) is None


@pytest.mark.slow
def test_inverting_gradients_unrolls_federated_averaging():

    torch.manual_seed(0)
    protocol = FedAvg(local_epochs=5, local_batch_size=1, local_lr=0.1)
    observed, threat, pixels, _ = _scenario(lenet_zhu(1, 10, 16), protocol=protocol)
    rec = InvertingGradients(iterations=600)(observed, threat, torch.Generator().manual_seed(2))
    assert psnr(rec.images, pixels).item() > 18.0
