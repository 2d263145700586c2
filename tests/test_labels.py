"""Label recovery: exact for one image, counting methods for batches with repeated labels."""
from __future__ import annotations

import pytest
import torch

from leakaudit.attacks.labels import counts_to_labels, recover_labels
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.run.scenario import loss_fn
from leakaudit.evaluator.zoo.datasets import load_digits
from leakaudit.evaluator.zoo.metrics import label_accuracy
from leakaudit.evaluator.zoo.models import lenet_zhu, mlp
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.protocol import FEDSGD, ClientStep, FedAvg, Protocol


def test_counts_round_to_a_multiset_of_the_batch_size():
    assert counts_to_labels(torch.tensor([2.6, 0.2, 1.3, -0.4]), 4).tolist() == [0, 0, 0, 2]
    assert counts_to_labels(torch.tensor([0.9, 0.9, 0.9]), 2).tolist() == [0, 1]


def _trials(method: str, batch: int, build, trials: int = 10, protocol: Protocol = FEDSGD) -> float:
    data = load_digits(image_size=32)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    scores = []
    for trial in range(trials):
        torch.manual_seed(trial)
        model = build()
        gen = torch.Generator().manual_seed(100 + trial)
        idx = torch.randperm(len(data.train_x), generator=gen)[:batch]
        labels = data.train_y[idx]
        step = ClientStep(model, loss_fn, (data.train_x[idx] - mean) / std, labels, gen, protocol)
        threat = ThreatModel(model, loss_fn, (1, 32, 32), mean, std, 10, batch, NoDefense(), protocol=protocol)
        got = recover_labels(NoDefense().share(step), threat, method, torch.Generator().manual_seed(trial))
        assert len(got) == batch
        scores.append(label_accuracy(got, labels))
    return sum(scores) / len(scores)


def test_batch_of_8_with_repeated_labels_on_lenet():
    data = load_digits(image_size=32)
    gen = torch.Generator().manual_seed(100)
    assert len(set(data.train_y[torch.randperm(len(data.train_y), generator=gen)[:8]].tolist())) < 8  # repeats
    assert _trials("feature_fit", 8, lambda: lenet_zhu(1, 10, 32)) >= 0.95
    assert _trials("geng", 8, lambda: lenet_zhu(1, 10, 32)) >= 0.9


def test_geng_without_output_bias():
    def biasless():
        model = mlp(1, 10, 32, width=64)
        model[-1] = torch.nn.Linear(64, 10, bias=False)
        return model
    assert _trials("geng", 8, biasless, trials=5) >= 0.9
    with pytest.raises(ValueError, match="needs the output layer's bias gradient; use 'geng'"):
        _trials("feature_fit", 8, biasless, trials=1)


def test_counting_works_on_a_fedavg_update():
    protocol = FedAvg(local_epochs=1, local_batch_size=4, local_lr=0.01)
    assert _trials("feature_fit", 8, lambda: lenet_zhu(1, 10, 32), trials=5, protocol=protocol) >= 0.9


def test_signs_miss_repeated_labels_that_counting_finds():
    assert _trials("signs", 8, lambda: lenet_zhu(1, 10, 32)) < _trials("feature_fit", 8, lambda: lenet_zhu(1, 10, 32))
