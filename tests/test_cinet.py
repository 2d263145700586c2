"""CI-Net (Zhang et al. 2023): a batch of 16 from lenet_zhu's averaged gradient, against Inverting Gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leakaudit.attacks.cinet import CHANNEL_LADDER, CINet, parameter_count
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.metrics import score
from leakaudit.evaluator.models import lenet_zhu
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.protocol import ClientStep


def batch16(registry):
    data = registry.get("dataset", "cifar10_samples").load(image_size=32, root=None, download=False)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    pixels = torch.cat([data.test_x, data.train_x])[:16]
    labels = torch.cat([data.test_y, data.train_y])[:16]
    torch.manual_seed(0)
    model = lenet_zhu(3, 10, 32)
    observed = NoDefense().share(ClientStep(model, F.cross_entropy, (pixels - mean) / std, labels, torch.Generator()))
    threat = ThreatModel(model, F.cross_entropy, (3, 32, 32), mean, std, 10, 16, NoDefense(), labels=labels)
    return observed, threat, pixels, labels


def test_the_generator_outnumbers_the_model_and_outputs_the_batch(registry):
    observed, threat, _, _ = batch16(registry)
    attack = CINet(iterations=1)
    net = attack.generator_for(threat, torch.Generator().manual_seed(0))
    assert parameter_count(net) > parameter_count(threat.model)
    assert net.channels == next(c for c in CHANNEL_LADDER if attack._count(c, threat) > parameter_count(threat.model))
    assert attack._count(net.channels, threat) == parameter_count(net)
    assert net().shape == (16, 3, 32, 32)


@pytest.mark.slow
def test_cinet_beats_inverting_gradients_and_a_grey_guess_on_a_batch_of_16(registry):
    """Issue 7: mean SSIM at least 0.1 above Inverting Gradients' at the same budget, and above flat grey."""
    observed, threat, pixels, labels = batch16(registry)
    ssim = registry.get("metric", "ssim")
    grey = score([ssim], torch.full_like(pixels, 0.5), pixels, labels, labels).values["ssim"]
    cinet = CINet(iterations=1000)(observed, threat, torch.Generator().manual_seed(1))
    ig = InvertingGradients(iterations=1000)(observed, threat, torch.Generator().manual_seed(1))
    ours = score([ssim], cinet.images, pixels, cinet.labels, labels).values["ssim"]
    theirs = score([ssim], ig.images, pixels, ig.labels, labels).values["ssim"]
    assert ours >= theirs + 0.1 and ours > grey, (ours, theirs, grey)
