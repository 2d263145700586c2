"""The BatchNorm statistics a client's update carries, and the prior that reads them (Yin et al. 2021;
Hatamizadeh et al. 2023): exact where the math gives them, refused in one line where they are missing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leakaudit.attacks.batchnorm_prior import batch_statistics, statistics_distance, target_statistics
from leakaudit.attacks.gradient_matching import InvertingGradients, InvertingGradientsBN
from leakaudit.attacks.vectorised import SharedModel
from leakaudit.defenses.noise import GaussianNoise as Gaussian, NoDefense
from leakaudit.defenses.soteria import Soteria
from leakaudit.plugins.attack import ATTACKERS, HONEST_SERVER, SERVER_READING_STATISTICS, Problem, ThreatModel
from leakaudit.plugins.protocol import (
    FEDSGD,
    RUNNING_BUFFERS,
    ClientStep,
    FedAvg,
    running_buffers,
    sent_batch_statistics,
)


def bn_cnn(momentum: float | None = 0.1) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6, momentum=momentum), nn.ReLU(),
                          nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6, momentum=momentum), nn.ReLU(),
                          nn.Flatten(), nn.Linear(6 * 8 * 8, 4))
    with torch.no_grad():  # running statistics away from their initial 0 and 1
        for _ in range(3):
            model(torch.randn(5, 3, 8, 8) * 2 + 1)
    return model.train()


def batch_of(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, 3, 8, 8, generator=g), torch.arange(n) % 4


def shared(model, x, y, protocol=FEDSGD, defense=None):
    return (defense or NoDefense()).share(ClientStep(model, F.cross_entropy, x, y, torch.Generator().manual_seed(2),
                                                     protocol))


def own_statistics(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    copy = SharedModel.of(model)
    return batch_statistics(copy.module, copy.params, copy.buffers, x)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_fedsgd_update_carries_the_batch_statistics_exactly(momentum):
    model = bn_cnn(momentum)
    x, y = batch_of()
    before = running_buffers(model)
    update = shared(model, x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, running_buffers(model)))  # the server's model is left be
    read = sent_batch_statistics(model, update.metadata[RUNNING_BUFFERS])
    truth = own_statistics(model, x)
    assert read is not None and len(read) == len(truth) == 4
    for r, t in zip(read, truth):
        assert torch.allclose(r, t, atol=1e-5, rtol=1e-5)


def test_fedavg_one_local_step_is_exact_and_several_mix_the_steps():
    model = bn_cnn()
    x, y = batch_of()
    one = sent_batch_statistics(model, shared(model, x, y, FedAvg(local_lr=1e-3)).metadata[RUNNING_BUFFERS])
    assert one is not None
    for r, t in zip(one, own_statistics(model, x)):
        assert torch.allclose(r, t, atol=1e-5, rtol=1e-5)
    # two minibatches of two: the read mean is (1 - m) mean_1 + mean_2 over (2 - m), weighed towards the last step
    two = sent_batch_statistics(model, shared(model, x, y, FedAvg(local_lr=1e-9, local_batch_size=2))
                                .metadata[RUNNING_BUFFERS])
    first, last = own_statistics(model, x[:2]), own_statistics(model, x[2:])
    assert two is not None
    assert torch.allclose(two[0], (0.9 * first[0] + last[0]) / 1.9, atol=1e-5)


def test_noise_leaves_the_buffers_and_eval_mode_sends_none_that_moved():
    model = bn_cnn()
    x, y = batch_of()
    noisy = shared(model, x, y, defense=Gaussian(sigma=1.0))
    clean = shared(model, x, y)
    assert all(torch.equal(a, b) for a, b in zip(noisy.metadata[RUNNING_BUFFERS], clean.metadata[RUNNING_BUFFERS]))
    model.eval()
    assert sent_batch_statistics(model, shared(model, x, y).metadata[RUNNING_BUFFERS]) is None
    with pytest.raises(ValueError, match="bn_prior: update: the update carries no BatchNorm statistics that moved"):
        target_statistics("update", model, shared(model, x, y))


def test_the_prior_is_zero_at_the_true_batch_and_not_elsewhere():
    model = bn_cnn()
    x, y = batch_of()
    target = target_statistics("update", model, shared(model, x, y))
    exact = statistics_distance(own_statistics(model, x), own_statistics(model, x))
    assert exact.item() == 0.0
    assert statistics_distance(own_statistics(model, x), target).item() < 1e-4
    assert statistics_distance(own_statistics(model, torch.rand_like(x)), target).item() > 0.1
    assert target_statistics("model", model, shared(model, x, y))[0].equal(model[1].running_mean)


def test_attacker_levels_and_refusals():
    assert list(ATTACKERS).index(SERVER_READING_STATISTICS) == list(ATTACKERS).index(HONEST_SERVER) + 1
    assert InvertingGradientsBN.attacker == SERVER_READING_STATISTICS and InvertingGradients.attacker == HONEST_SERVER
    with pytest.raises(ValueError, match="bn_prior.*'update'.*choices: none, model"):
        InvertingGradients(bn_prior="update")
    with pytest.raises(ValueError, match="bn_weight"):
        InvertingGradientsBN(bn_weight=-1.0)
    attack = InvertingGradientsBN()
    plain = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
    assert "needs a model whose every BatchNorm layer keeps running statistics" in attack.unsupported(plain, 4, FEDSGD)
    assert "eval mode" in attack.unsupported(bn_cnn().eval(), 4, FEDSGD)
    assert attack.unsupported(bn_cnn(), 4, FEDSGD) is None
    assert "sends no BatchNorm buffers" in attack.unsupported_defense(Soteria())
    assert attack.unsupported_defense(Gaussian(sigma=0.1)) is None
    assert InvertingGradients().unsupported(plain, 4, FEDSGD) is None  # no prior asked: any model


def test_one_problem_and_batched_paths_agree_with_the_prior():
    model = bn_cnn()
    x, y = batch_of(2)
    mean, std = torch.zeros(3, 1, 1), torch.ones(3, 1, 1)
    threat = ThreatModel(model, F.cross_entropy, (3, 8, 8), mean, std, 4, 2, NoDefense(), labels=y)
    observed = shared(model, x, y)
    attack = InvertingGradientsBN(iterations=5, bn_weight=1.0)
    before = running_buffers(model)
    alone = attack(observed, threat, torch.Generator().manual_seed(3))
    problems = [Problem(observed, threat, torch.Generator().manual_seed(3), attack) for _ in range(2)]
    together = InvertingGradientsBN.reconstruct_all(problems, max_problems=2)
    assert all(torch.equal(a, b) for a, b in zip(before, running_buffers(model)))
    for rec in together:
        assert torch.allclose(rec.images, alone.images, atol=1e-4)
        assert rec.extras["match_loss"] == pytest.approx(alone.extras["match_loss"], rel=1e-4, abs=1e-6)
