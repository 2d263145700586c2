"""FedAvg updates and image priors: exact values where the math gives them."""
from __future__ import annotations

import pytest
import torch

from leakaudit.attacks.priors import check_priors, l2_norm, pixel_range, prior_penalty, total_variation_isotropic
from leakaudit.evaluator.run.scenario import loss_fn
from leakaudit.evaluator.zoo.models import lenet_zhu
from leakaudit.plugins.protocol import FedAvg, fedsgd_update


def test_one_local_step_is_lr_times_the_gradient():
    torch.manual_seed(0)
    model = lenet_zhu(1, 10, 16)
    x, y = torch.rand(2, 1, 16, 16), torch.tensor([1, 4])
    delta = FedAvg(local_epochs=1, local_lr=0.1).attacker_update(model, loss_fn, x, y, create_graph=False)
    grad = fedsgd_update(model, loss_fn, x, y)
    assert all(torch.allclose(d, 0.1 * g, atol=1e-7) for d, g in zip(delta, grad))


def test_local_steps_match_plain_sgd_and_stay_differentiable():
    torch.manual_seed(0)
    model = lenet_zhu(1, 10, 16)
    x, y = torch.rand(4, 1, 16, 16), torch.tensor([1, 4, 4, 2])
    protocol = FedAvg(local_epochs=2, local_batch_size=2, local_lr=0.05)
    assert protocol.local_steps(4) == 4
    copy = lenet_zhu(1, 10, 16)
    copy.load_state_dict(model.state_dict())
    sgd = torch.optim.SGD(copy.parameters(), lr=0.05)
    for _ in range(2):
        for i in (0, 2):
            sgd.zero_grad()
            loss_fn(copy(x[i:i + 2]), y[i:i + 2]).backward()
            sgd.step()
    delta = protocol.attacker_update(model, loss_fn, x, y, create_graph=False)
    for d, p0, p1 in zip(delta, model.parameters(), copy.parameters()):
        assert torch.allclose(d, p0 - p1, atol=1e-6)
    xr = x.clone().requires_grad_(True)
    total = sum(d.sum() for d in protocol.attacker_update(model, loss_fn, xr, y, create_graph=True))
    assert torch.autograd.grad(total, xr)[0].abs().sum() > 0


def test_priors_exact_values():
    img = torch.zeros(1, 1, 3, 3)
    img[0, 0, 0, 0] = 1.0
    # isotropic TV over the 2x2 top-left anchors: only the (0,0) anchor has dx = dy = -1
    assert total_variation_isotropic(img, eps=0.0).item() == pytest.approx(2 ** 0.5 / 4)
    assert l2_norm(img).item() == pytest.approx(1 / 9)
    lo, hi = torch.zeros(1, 1, 1), torch.ones(1, 1, 1)
    assert pixel_range(img * 3 - 1, lo, hi).item() == pytest.approx((1 + 8 * 1) / 9)  # one pixel at 2, eight at -1
    assert prior_penalty(img, {"l2": 2.0, "tv": 0.0}, lo, hi).item() == pytest.approx(2 / 9)
    with pytest.raises(ValueError, match="unknown prior 'tvv'; choices: tv, tv_iso, l2, range"):
        check_priors({"tvv": 1.0})
