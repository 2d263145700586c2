"""ARES (Gong et al. 2026): a malicious server crafts the weights of a model as it is, and reads each image of a
batch back from its activation at one fully connected layer (imprint bins, then the generalised Lasso)."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leakaudit.attacks.ares import Ares, Layout, craft, crafted_layout, dct2, expected_recovery_rate, lasso, layout
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.run.runner import run_audit
from leakaudit.evaluator.zoo.models import ARES_BASES, ZOO, ares, cnn_bayes, mlp
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.protocol import FedAvg, FedSGD


def _digits(size: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data = load_registry().get("dataset", "digits").load(image_size=size, root=None, download=False)
    return data.test_x[:count], data.test_y[:count], data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)


def _attack(model, images, labels, mean, std, noise: float = 0.0, **settings) -> torch.Tensor:
    """The attack's images (pixel space) from the FedSGD update of ``images``, ``noise`` added to every
    coordinate; labels known."""
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(F.cross_entropy(model((images - mean) / std), labels), params)
    gen = torch.Generator().manual_seed(0)
    grads = [g + noise * torch.randn(g.shape, generator=gen) for g in grads]
    threat = ThreatModel(model, F.cross_entropy, tuple(images.shape[1:]), mean, std, 10, len(images),
                         load_registry().get("defense", "none")(), labels=labels)
    return Ares(**settings)(SharedUpdate(list(grads), list(names), len(images)), threat, gen).images


def _best_psnr(found: torch.Tensor, originals: torch.Tensor) -> torch.Tensor:
    """Each original's PSNR against its closest reconstruction."""
    mse = ((found[None] - originals[:, None]) ** 2).flatten(2).mean(2).min(1).values
    return -10 * torch.log10(mse.clamp_min(1e-12))


def test_a_crafted_cnn_gives_back_its_batch_of_8_to_float_precision():
    """cnn_bayes at 8 px: 128 measurements of 64 pixels, so the Lasso's solution is the image itself."""
    images, labels, mean, std = _digits(8, 8)
    torch.manual_seed(0)
    model = ares(1, 10, 8, base="cnn_bayes")
    psnr = _best_psnr(_attack(model, images, labels, mean, std, basis="pixels"), images)
    assert (psnr > 45).sum() >= 7  # measured: all 8 between 52 and 59 dB (100 bins: 7.4 expected alone)


def test_strong_noise_on_the_update_leaves_nothing_recognisable():
    images, labels, mean, std = _digits(8, 8)
    torch.manual_seed(0)
    model = ares(1, 10, 8, base="cnn_bayes")
    psnr = _best_psnr(_attack(model, images, labels, mean, std, noise=1.0, basis="pixels"), images)
    assert (psnr < 15).all()  # measured: at most 11 dB


def test_the_lasso_recovers_what_least_squares_cannot_from_fewer_measurements_than_pixels():
    """An MLP at 16 px whose first layer measures 128 of 256 pixels, imprinted at its second layer: the DCT
    Lasso beats the minimum-norm least-squares image (lambda 0) by far, and gets a recognisable digit."""
    images, labels, mean, std = _digits(16, 4)
    torch.manual_seed(0)
    model = craft(mlp(1, 10, 16, width=256, depth=2), (1, 16, 16), layer=2)
    lassoed = _best_psnr(_attack(model, images, labels, mean, std, basis="dct", lasso_lambda=1e-3), images)
    plain = _best_psnr(_attack(model, images, labels, mean, std, basis="dct", lasso_lambda=0.0), images)
    assert lassoed.mean() > plain.mean() + 8  # measured: 25.1 dB against 11.8
    assert lassoed.mean() > 20


def test_fista_finds_a_sparse_vector_from_few_gaussian_measurements():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(60, 128, generator=gen) / math.sqrt(60)
    truth = torch.zeros(3, 128)
    for row in truth:
        row[torch.randperm(128, generator=gen)[:5]] = torch.randn(5, generator=gen).sign() * 2
    found = lasso(k, truth @ k.T, torch.full((3, 1), 1e-4), 3000)
    assert ((found - truth).norm(dim=1) / truth.norm(dim=1)).max() < 1e-2


def test_the_dct_is_orthonormal():
    x = torch.randn(2, 3, 8, 6)
    assert torch.allclose(dct2(dct2(x), inverse=True), x, atol=1e-5)
    assert torch.allclose(dct2(x).norm(), x.norm(), atol=1e-4)


def test_the_expected_recovery_rate():
    assert expected_recovery_rate(1, 1) == pytest.approx(0.5)  # one threshold: half the images activate it
    assert expected_recovery_rate(100, 8) == pytest.approx(100 / 101 * (100 / 101) ** 7)


def test_only_a_crafted_model_and_one_step_per_client_are_read():
    attack = Ares()
    assert "model: {name: ares" in attack.unsupported(cnn_bayes(1, 10, 8), 8, FedSGD())
    torch.manual_seed(0)
    model = ares(1, 10, 8)
    assert attack.unsupported(model, 8, FedSGD()) is None
    assert "local steps" in attack.unsupported(model, 8, FedAvg(local_batch_size=1))


def test_the_networks_ares_cannot_craft_are_refused_in_one_line():
    bases = {spec.name: spec.build for spec in ZOO}
    refusals = {name: layout(bases[name](1, 10, 16), 1)
                for name in ("lenet_zhu", "convnet", "resnet20", "cnn2_v1", *ARES_BASES)}
    assert all(isinstance(refusals[name], Layout) for name in ARES_BASES)
    assert "needs one after it; the model has 1 fully connected layers" in refusals["convnet"]
    assert "forward of its own" in refusals["resnet20"]
    assert "has 1 fully connected layers" in refusals["lenet_zhu"] and "has 1" in refusals["cnn2_v1"]
    pooled = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                           nn.Linear(36, 8), nn.ReLU(), nn.Linear(8, 2))
    assert "through BatchNorm2d (convolutions, ReLUs" in layout(pooled, 1)
    odd = nn.Sequential(nn.Flatten(), nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    assert "odd number" in layout(odd, 2)


def test_crafting_keeps_every_layer_and_marks_the_imprint():
    torch.manual_seed(0)
    plain, crafted = cnn_bayes(3, 10, 16), ares(3, 10, 16)
    assert [type(m) for m in plain.modules()] == [type(m) for m in crafted.modules()]
    assert [p.shape for p in plain.parameters()] == [p.shape for p in crafted.parameters()]
    assert crafted_layout(plain) is None and crafted_layout(crafted) is not None


@pytest.mark.slow
def test_a_cifar_batch_through_the_audit_engine(write_audit, tmp_path):
    """cnn_bayes on CIFAR-10 photographs at 32 px (2,048 measurements of 3,072 pixels): undefended most images come
    back recognisable, under Gaussian noise of sigma 0.01 on the update none does (docs/results.md, ARES)."""
    audit = {"name": "ares", "seed": 0, "device": "cpu",
             "data": {"dataset": "cifar10_samples", "image_size": 32, "targets": 8, "batch_size": 8},
             "model": {"name": "ares", "params": {"base": "cnn_bayes"}, "checkpoints": [0]},
             "threat": {"known_labels": True},
             "defenses": [{"name": "none"}, {"name": "gaussian", "params": {"sigma": 0.01}}],
             "attacks": [{"name": "ares"}], "utility": {"train_steps": 0}, "metrics": ["psnr"]}
    run_audit(load_audit(write_audit(audit)), tmp_path / "run", progress=False)
    rows = {r["setting"]: r for r in map(json.loads, (tmp_path / "run" / "results.jsonl").read_text().splitlines())}
    undefended = rows["none"]["per_image"]["psnr"]
    noisy = rows["gaussian(sigma=0.01)"]["per_image"]["psnr"]
    assert sum(p > 20 for p in undefended) >= 5
    assert max(noisy) < 15
    html = (tmp_path / "run" / "report.html").read_text()
    assert "malicious: the server sent the model with weights it crafted" in html
