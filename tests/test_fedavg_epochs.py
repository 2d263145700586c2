"""FedAvg's per-epoch shuffle, and ``fedavg_epochs`` (Dimitrov et al. 2022) reading a client whose batch order the
attacker does not know."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from leakaudit.attacks.fedavg_epochs import FedAvgEpochs, invariant_prior, merged_copies
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.defenses.noise import NoDefense
from leakaudit.defenses.precode import Precode
from leakaudit.evaluator.zoo.metrics import best_assignment
from leakaudit.evaluator.zoo.models import mlp
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.protocol import FEDSGD, ClientStep, FedAvg


def _client(images: int = 4):
    torch.manual_seed(0)
    return mlp(1, 10, 8, width=32), torch.randn(images, 1, 8, 8), torch.arange(images) % 10


def test_shuffle_trains_each_epoch_in_an_order_drawn_from_the_clients_generator():
    model, x, y = _client()
    shuffled = FedAvg(local_epochs=1, local_batch_size=2, local_lr=0.1, shuffle=True)
    got = shuffled.client_update(model, F.cross_entropy, x, y, torch.Generator().manual_seed(3))
    order = torch.randperm(4, generator=torch.Generator().manual_seed(3))
    in_order = FedAvg(local_epochs=1, local_batch_size=2, local_lr=0.1)
    want = in_order.client_update(model, F.cross_entropy, x[order], y[order])
    assert not torch.equal(order, torch.arange(4))
    assert all(torch.allclose(g, w, atol=1e-7) for g, w in zip(got, want))
    plain = in_order.client_update(model, F.cross_entropy, x, y)
    assert any((g - p).abs().max() > 1e-5 for g, p in zip(got, plain))  # the order changed the update


def test_without_shuffle_the_update_and_the_generator_stay_as_they_were():
    model, x, y = _client()
    protocol = FedAvg(local_epochs=2, local_batch_size=2, local_lr=0.1)
    generator = torch.Generator().manual_seed(5)
    step = ClientStep(model, F.cross_entropy, x, y, generator, protocol)
    clean = step.clean_update()
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(5).get_state())
    unrolled = protocol.attacker_update(model, F.cross_entropy, x, y, create_graph=False)
    assert all(torch.equal(c, u) for c, u in zip(clean, unrolled))


def test_the_invariant_prior_ignores_each_epochs_order_and_the_merge_undoes_it():
    torch.manual_seed(1)
    first, labels = torch.randn(6, 1, 4, 4), torch.tensor([0, 0, 1, 1, 2, 2])
    perm = torch.tensor([1, 0, 3, 2, 5, 4])  # within each label
    copies = torch.stack([first, first[perm] + 0.01])
    assert float(invariant_prior(copies, labels, 0.05)) < 2e-4 / 6  # 0.01 squared over 6 images, matched past the order
    assert torch.allclose(merged_copies(copies, labels), first + 0.005, atol=1e-6)
    far = torch.stack([first, torch.randn(6, 1, 4, 4)])
    assert float(invariant_prior(far, labels, 0.05)) > 0.1 / 6


def test_fedavg_epochs_declares_its_reach():
    model, attack = mlp(1, 10, 8), FedAvgEpochs()
    assert attack.attacker and attack.paper == "Dimitrov et al. 2022" and attack.auto_settings("cpu")
    assert attack.unsupported(model, 64, FedAvg(local_epochs=2, local_batch_size=16, shuffle=True)) is None
    assert attack.unsupported(model, 64, FedAvg(local_epochs=1, local_batch_size=16)) is None  # 4 steps
    assert "more than one local step" in attack.unsupported(model, 64, FedAvg(local_epochs=1))
    assert "FedAvg" in attack.unsupported(model, 64, FEDSGD)
    assert "clients: 4" in attack.unsupported(model, 64, FedAvg(local_epochs=2, local_batch_size=4, clients=4))
    assert "fedavg_epochs" in load_registry().entries["attack"]
    noisy = Precode().wrap_model(mlp(1, 10, 8))
    assert "draws noise" in attack.unsupported(noisy, 64, FedAvg(local_epochs=2, local_batch_size=16))


def _psnr(a, b):
    return float((-10 * torch.log10(((a - b) ** 2).flatten(1).mean(1))).mean())


def test_fedavg_epochs_recovers_individuals_from_shuffled_epochs_and_beats_in_order_unrolling():
    """16 digits through 2 shuffled epochs of 2 batches on an untrained MLP: the per-epoch copies reach past the
    class means by more than the 1 dB margin, and past Inverting Gradients' in-order unrolling of the same update."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small kernels: a second thread only waits, on loaded CPUs by milliseconds per op
    try:
        scores, class_means = _shuffled_scores(seed=2, iterations=150)
    finally:
        torch.set_num_threads(threads)
    assert scores["fedavg_epochs"] > class_means + 1.0, scores
    assert scores["fedavg_epochs"] > scores["inverting_gradients"] + 0.5, scores


def _shuffled_scores(seed: int, iterations: int) -> tuple[dict[str, float], float]:
    """Each attack's mean PSNR on 16 digits of a shuffling client, and the class means' PSNR."""
    data = load_registry().get("dataset", "digits").load(image_size=8, root=None, download=False)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    pick = torch.randperm(len(data.test_x), generator=torch.Generator().manual_seed(seed))[:16]
    pixels, labels = data.test_x[pick], data.test_y[pick]
    torch.manual_seed(seed)
    model = mlp(1, 10, 8, width=64)
    protocol = FedAvg(local_epochs=2, local_batch_size=8, local_lr=0.1, shuffle=True)
    observed = NoDefense().share(ClientStep(model, F.cross_entropy, (pixels - mean) / std, labels,
                                            torch.Generator().manual_seed(1), protocol))
    threat = ThreatModel(model, F.cross_entropy, (1, 8, 8), mean, std, 10, 16, NoDefense(), protocol=protocol)
    class_means = torch.stack([data.train_x[data.train_y == c].mean(0) for c in range(10)])[labels]
    scores = {}
    for attack in (FedAvgEpochs(iterations=iterations), InvertingGradients(iterations=iterations)):
        rec = attack(observed, threat, torch.Generator().manual_seed(2)).images
        scores[attack.name] = _psnr(rec[best_assignment(rec, pixels)], pixels)
    return scores, _psnr(class_means, pixels)


def test_auto_chooses_it_for_fedavg_with_several_local_steps_alone(write_audit):
    from leakaudit.evaluator.audit.config import load_audit

    audit = {"name": "auto_fedavg", "seed": 0, "device": "cpu",
             "data": {"dataset": "digits", "image_size": 8, "targets": 16, "batch_size": 16},
             "model": {"name": "mlp", "checkpoints": [0]}, "defenses": [{"name": "none"}],
             "protocol": {"name": "fedavg", "local_epochs": 2, "local_batch_size": 8, "local_lr": 0.1, "shuffle": True},
             "metrics": ["psnr"]}
    from leakaudit.evaluator.results.report import threat_model

    loaded = load_audit(write_audit(audit))
    chosen = {a.name: a.params for a in loaded.attacks}
    assert chosen["fedavg_epochs"] == FedAvgEpochs.auto_params["cpu"] and "inverting_gradients" in chosen
    assert dict(threat_model(loaded))["Protocol"] == (
        "fedavg (local_epochs=2, local_batch_size=8, local_lr=0.1); one update of 16 private image(s); each local "
        "epoch in an order the client draws and the server does not know")
    plain = load_audit(write_audit({**audit, "protocol": "fedsgd"}, "fedsgd.yaml"))
    lines = dict(line.split(": ", 1) for line in plain.attack_choice)
    assert lines["fedavg_epochs"] == ("left out: fedavg_epochs reads a FedAvg client's local training (protocol "
                                      "fedsgd sends no such update)")


def test_problems_solved_together_match_each_solved_alone():
    from leakaudit.plugins.attack import Problem

    model, x, y = _client(8)
    protocol = FedAvg(local_epochs=2, local_batch_size=4, local_lr=0.1, shuffle=True)
    threat = ThreatModel(model, F.cross_entropy, (1, 8, 8), torch.zeros(1, 1, 1), torch.ones(1, 1, 1), 10, 8,
                         NoDefense(), labels=y, protocol=protocol)
    updates = [NoDefense().share(ClientStep(model, F.cross_entropy, x * s, y, torch.Generator().manual_seed(1),
                                            protocol)) for s in (1.0, 0.5)]
    attack = FedAvgEpochs(iterations=5, restarts=2)
    together = FedAvgEpochs.reconstruct_all([Problem(u, threat, torch.Generator().manual_seed(i), attack)
                                             for i, u in enumerate(updates)], max_problems=4)
    alone = [attack.reconstruct(u, threat, torch.Generator().manual_seed(i)) for i, u in enumerate(updates)]
    for t, a in zip(together, alone):
        assert t.images.shape == (8, 1, 8, 8) and torch.equal(t.labels, a.labels)
        assert torch.allclose(t.images, a.images, atol=1e-4)
