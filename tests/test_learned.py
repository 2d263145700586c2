"""Learning to Invert (Wu et al. 2023): an inversion network trained on the attacker's own images' updates."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn

from leakaudit.attacks import learned
from leakaudit.attacks.learned import (CHUNK, LearningToInvert, canonical_order, chunk_for, chunk_updates,
                                       standard_deviations, training_updates, vectorisable)
from leakaudit.defenses.ats import ATS
from leakaudit.defenses.noise import GaussianNoise, NoDefense
from leakaudit.defenses.soteria import Soteria
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.run.runner import run_audit
from leakaudit.plugins.attack import AuxiliaryData, Problem, ThreatModel
from leakaudit.plugins.defense import Defense, SharedUpdate
from leakaudit.plugins.protocol import FEDSGD, ClientStep, FedAvg, Protocol


def test_batches_are_taught_in_label_then_brightness_order():
    pixels = torch.stack([torch.full((1, 2, 2), v) for v in (0.9, 0.1, 0.5, 0.3)])
    labels = torch.tensor([1, 1, 0, 1])
    assert canonical_order(pixels, labels).tolist() == [2, 1, 3, 0]


def _digits_threat(model: nn.Module, batch: int, auxiliary: AuxiliaryData | None) -> ThreatModel:
    return ThreatModel(model=model, loss_fn=F.cross_entropy, input_shape=(1, 8, 8), mean=torch.full((1, 1, 1), 0.3),
                       std=torch.full((1, 1, 1), 0.4), num_classes=10, batch_size=batch, defense=NoDefense(),
                       auxiliary=auxiliary)


@pytest.mark.slow
def test_it_learns_to_read_held_out_images_from_their_updates():
    """Trained on the updates of 1,500 digits, the network reads 16 others, one per update, far better than the
    mean image does: it never saw them, and it needs no likelihood."""
    torch.manual_seed(0)
    digits = load_digits()
    pixels = torch.tensor(digits.images / 16, dtype=torch.float32)[:, None]
    labels = torch.tensor(digits.target)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    threat = _digits_threat(model, 1, AuxiliaryData(pixels, labels, torch.arange(16, len(pixels))))
    problems, attack = [], LearningToInvert(updates=1500, iterations=1500, width=256, minibatch=64)
    for i in range(16):
        gen = torch.Generator().manual_seed(i)
        step = ClientStep(model, F.cross_entropy, threat.normalise(pixels[i:i + 1]), labels[i:i + 1], gen, FEDSGD)
        problems.append(Problem(NoDefense().share(step), threat, gen, attack))
    recs = LearningToInvert.reconstruct_all(problems)
    mse = torch.stack([(r.images[0] - pixels[i]).pow(2).mean() for i, r in enumerate(recs)])
    mean_mse = (pixels[16:].mean(dim=0, keepdim=True) - pixels[:16]).pow(2).flatten(1).mean(dim=1)
    # measured: 21.6 dB against the mean image's 11.4 dB, all 16 closer than the mean image
    assert (10 * torch.log10(1 / mse)).mean() > 10 * torch.log10(1 / mean_mse).mean() + 4
    assert bool((mse < mean_mse).all())
    assert [r.labels.item() for r in recs] == labels[:16].tolist()  # signs of the output layer's gradient
    assert len({id(r.loss_trace) for r in recs}) == 1  # one network for the cell's updates


def test_without_images_of_its_own_it_says_what_it_needs():
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    threat = _digits_threat(model, 4, None)
    update = SharedUpdate([torch.zeros(10, 64), torch.zeros(10)], ["1.weight", "1.bias"], 4)
    with pytest.raises(ValueError, match="learning_to_invert learns from the attacker's own images .* it has 0, "
                                         "needs at least 4"):
        LearningToInvert()(update, threat, torch.Generator().manual_seed(0))


@pytest.mark.heavy
def test_it_beats_inverting_gradients_on_a_trained_cnn_under_noise(write_audit, tmp_path):
    """Issue 43's measure: 16 images per update on cnn_bayes after 1,000 training steps, Gaussian noise."""
    audit = {"name": "lti", "seed": 0, "device": "cpu",
             "data": {"dataset": "digits", "image_size": 16, "targets": 32, "batch_size": 16},
             "model": {"name": "cnn_bayes", "checkpoints": [1000]},
             "defenses": [{"name": "gaussian", "params": {"sigma": 0.01}}],
             "attacks": [{"name": "inverting_gradients", "params": {"iterations": 300}},
                         {"name": "learning_to_invert", "params": {"updates": 2048, "iterations": 1500}}],
             "utility": {"train_steps": 1000, "batch_size": 16, "lr": 0.1},
             "metrics": ["psnr", "label_accuracy"]}
    out = tmp_path / "lti"
    run_audit(load_audit(write_audit(audit, "lti.yaml")), out, progress=False)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    psnr = {a: sum(r["psnr"] for r in rows if r["attack"] == a) / 2 for a in ("inverting_gradients",
                                                                           "learning_to_invert")}
    baselines = json.loads((out / "baselines.json").read_text())
    # measured: 14.1 dB against Inverting Gradients' 10.2 and the mean image's 13.3
    assert psnr["learning_to_invert"] > psnr["inverting_gradients"] + 2
    assert psnr["learning_to_invert"] > baselines["mean"]["psnr"]


def test_a_coordinate_that_never_moved_is_read_as_zero_and_a_barely_moving_one_is_floored():
    inputs = torch.tensor([[1.0, 0.0, 5.0], [3.0, 0.0, 5.001]])
    std = standard_deviations(inputs)
    typical = (2 ** 0.5 + 0.001 / 2 ** 0.5) / 3
    assert std[0] == pytest.approx(2 ** 0.5) and std[1] == math.inf
    assert std[2] == pytest.approx(0.01 * typical)  # moved 7e-4, under a hundredth of a typical coordinate
    assert ((torch.tensor([2.0, 0.3, 5.0]) - inputs.mean(0)) / std)[1] == 0  # a target's value there is not read


def _cnn_threat(defense: Defense, protocol: Protocol = FEDSGD, extra: list[nn.Module] | None = None) -> ThreatModel:
    digits = load_digits()
    pixels = torch.tensor(digits.images / 16, dtype=torch.float32)[:, None]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), *(extra or []), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                          nn.Linear(64, 10))
    return replace(_digits_threat(model, 4, AuxiliaryData(pixels, torch.tensor(digits.target), torch.arange(16, 400))),
                   defense=defense, protocol=protocol)


def _updates(threat: ThreatModel, count: int) -> tuple[Tensor, Tensor, int, float]:
    """``training_updates`` from fixed seeds, and each generator's next draw (the draws they made must agree)."""
    cpu, device = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    inputs, targets = training_updates(threat, torch.arange(0, 394, 3), count, cpu, device)
    return inputs, targets, int(torch.randint(10 ** 9, (1,), generator=cpu)), float(torch.randn(1, generator=device))


def test_the_vmapped_simulated_updates_are_the_loops_to_float_rounding(monkeypatch):
    """Under noise, across a chunk's end: the same batches, the same noise in the same order, the same images."""
    threat = _cnn_threat(GaussianNoise(sigma=0.01))
    assert vectorisable(threat)
    looped, looped_targets, looped_cpu_next, looped_device_next = _updates(threat, 22)  # one thread: the loop
    passes = []
    monkeypatch.setattr(learned, "chunk_for", lambda threat, count: 16)
    monkeypatch.setattr(learned, "chunk_updates", lambda *a: passes.append(len(a[1])) or chunk_updates(*a))
    inputs, targets, cpu_next, device_next = _updates(threat, 22)
    assert passes == [16, 6]
    assert torch.equal(targets, looped_targets) and (cpu_next, device_next) == (looped_cpu_next, looped_device_next)
    assert torch.allclose(inputs, looped, rtol=0, atol=1e-6)  # unit rows: gradients summed in another order


@pytest.mark.parametrize("case", ["batchnorm in training", "dropout in training", "fedavg", "augments", "shares itself"])
def test_the_simulated_updates_are_looped_where_a_batch_is_not_a_pure_function_of_the_weights(case, monkeypatch):
    defense: Defense = {"augments": ATS(), "shares itself": Soteria()}.get(case, NoDefense())
    protocol: Protocol = FedAvg() if case == "fedavg" else FEDSGD
    extra = {"batchnorm in training": [nn.BatchNorm2d(4)], "dropout in training": [nn.Dropout(0.5)]}.get(case, [])
    threat = _cnn_threat(defense, protocol, extra)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # where the vmapped pass would run
    monkeypatch.setattr(learned, "chunk_updates", lambda *a: pytest.fail("a vmapped pass"))
    assert not vectorisable(threat) and chunk_for(threat, 3) == 1 and len(_updates(threat, 3)[0]) == 3
    threat.model.eval()  # no statistics kept, no unit dropped: one pure function again
    assert vectorisable(threat) == (case in ("batchnorm in training", "dropout in training"))


def test_a_single_cpu_thread_loops_where_the_vmapped_pass_is_no_faster(monkeypatch):
    threat = _cnn_threat(NoDefense())
    for threads, chunk in ((1, 1), (2, CHUNK)):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        assert chunk_for(threat, 2048) == chunk


def test_a_forward_vmap_refuses_takes_the_loop_from_there_with_the_same_draws(monkeypatch):
    """A model that drops units functionally, say, passes ``vectorisable`` but not vmap: the chunk and the rest
    are looped, and the updates are the loop's."""
    threat = _cnn_threat(GaussianNoise(sigma=0.01))
    looped = _updates(threat, 22)
    passes = []

    def refuse(*args):
        passes.append(len(args[1]))
        raise RuntimeError("vmap: called random operation while in randomness error mode")

    monkeypatch.setattr(learned, "chunk_for", lambda threat, count: 16)
    monkeypatch.setattr(learned, "chunk_updates", refuse)
    fallen = _updates(threat, 22)
    assert passes == [16] and torch.equal(fallen[0], looped[0]) and torch.equal(fallen[1], looped[1])
    assert fallen[2:] == looped[2:]
