"""The BatchNorm-statistics prior against plain Inverting Gradients on a BatchNorm CNN (Yin et al. 2021, Table 1's
R_BN ablation; Hatamizadeh et al. 2023, the statistics a client's update carries).

Case: the 20 CIFAR-10 photos of the foolbox wheel at 32 px, cut in batches of ``--batch`` (8: two batches, 16
images); the zoo's ``resnet20`` (He et al.'s CIFAR ResNet-20, 19 BatchNorm layers) at width ``--width``, untrained,
in train mode; one FedSGD client; its running statistics first moved by the 20 CIFAR-100 photos of the same wheel
(the population an honest server's model has seen, never the targets). Labels given (as in Yin et al.'s Table 1
ablation, which recovers them exactly first). Each batch is attacked by ``inverting_gradients`` (no BatchNorm
prior), with the model's running statistics (``bn_prior: model``, Yin et al.'s R_BN) and by
``inverting_gradients_bn`` (the batch's own statistics read off the sent buffers), from the same starts. Prints
the mean PSNR (reconstructions matched to originals at least MSE) per attack and batch, and the seconds.

    python benchmarks/batchnorm_prior.py [--batch 8] [--iterations 400] [--width 16] [--weight 0.1] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from leakaudit.attacks.gradient_matching import InvertingGradients, InvertingGradientsBN
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.zoo.datasets import _foolbox_loader
from leakaudit.evaluator.zoo.metrics import best_assignment, psnr
from leakaudit.evaluator.zoo.models import resnet20
from leakaudit.plugins.attack import Attack, Problem, ThreatModel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import FEDSGD, ClientStep


def photos(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All 20 photos of a foolbox sample set (train and test halves), in [0, 1], with their labels."""
    data = _foolbox_loader(name)(image_size=32)
    return torch.cat([data.train_x, data.test_x]), torch.cat([data.train_y, data.test_y])


def cases(batch: int, width: int, seed: int = 0) -> list[tuple[SharedUpdate, ThreatModel, torch.Tensor]]:
    """Each target batch's observed update, threat model and photos: the untrained ResNet-20 in train mode, its
    running statistics moved by the CIFAR-100 photos (the population an honest server's model has seen)."""
    x, y = photos("cifar10_samples")
    population, _ = photos("cifar100_samples")
    mean, std = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1), torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    torch.manual_seed(seed)
    model = resnet20(3, 10, 32, width=width).train()
    with torch.no_grad():  # the running statistics of a model that has seen natural images, not the targets
        for _ in range(20):
            model((population - mean) / std)
    out = []
    for b in range(len(x) // batch):
        pixels, labels = x[b * batch:(b + 1) * batch], y[b * batch:(b + 1) * batch]
        observed = NoDefense().share(ClientStep(model, F.cross_entropy, (pixels - mean) / std, labels,
                                                torch.Generator().manual_seed(seed + b), FEDSGD))
        threat = ThreatModel(model, F.cross_entropy, (3, 32, 32), mean, std, 10, batch, NoDefense(), labels=labels)
        out.append((observed, threat, pixels))
    return out


def scored(attacks: dict[str, Attack], batches: list[tuple[SharedUpdate, ThreatModel, torch.Tensor]],
           seed: int = 0) -> dict[str, list[float]]:
    """Mean PSNR per attack and target batch, every batch at once, each from its own seeded start; each attack's
    line printed as it finishes."""
    scores: dict[str, list[float]] = {}
    width = max(map(len, attacks))
    for name, attack in attacks.items():
        start = time.perf_counter()
        recs = type(attack).reconstruct_all([Problem(o, t, torch.Generator().manual_seed(seed + b), attack)
                                             for b, (o, t, _) in enumerate(batches)])
        scores[name] = [float(psnr(rec.images[best_assignment(rec.images, pixels)], pixels).mean())
                        for rec, (_, _, pixels) in zip(recs, batches)]
        print(f"{name:>{width}}: {' '.join(f'{s:6.2f}' for s in scores[name])} dB  "
              f"{time.perf_counter() - start:6.1f} s", flush=True)
    return scores


def run(batch: int, iterations: int, width: int, weight: float, seed: int = 0) -> dict[str, list[float]]:
    """Mean PSNR per attack and target batch."""
    attacks: dict[str, Attack] = {
        "none": InvertingGradients(iterations=iterations, bn_prior="none"),
        "model": InvertingGradients(iterations=iterations, bn_prior="model", bn_weight=weight),
        "update": InvertingGradientsBN(iterations=iterations, bn_weight=weight)}
    return scored(attacks, cases(batch, width, seed), seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--weight", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scores = run(args.batch, args.iterations, args.width, args.weight)
    for name, values in scores.items():
        print(f"{name:>6}: mean PSNR {sum(values) / len(values):6.2f} dB over {len(values)} batches of {args.batch}")


if __name__ == "__main__":
    main()
