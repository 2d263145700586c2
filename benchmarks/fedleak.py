"""FedLeak's two changes to gradient matching against plain Inverting Gradients (Fan et al. 2025, its abstract's
partial gradient matching and gradient regularization), on benchmarks/batchnorm_prior.py's case.

Case: the 20 CIFAR-10 photos of the foolbox wheel at 32 px, cut in batches of ``--batch`` (8: two batches, 16
images); the zoo's ``resnet20`` at width ``--width``, untrained, in train mode, its running statistics first moved
by the 20 CIFAR-100 photos of the same wheel; one FedSGD client; labels given. Each batch is attacked by
``inverting_gradients``, by ``fedleak`` with partial matching only (``--partial``, no regularization), with the
regularization only (``partial: 1``, ``--rho``) and with both, from the same starts. Prints the mean PSNR
(reconstructions matched to originals at least MSE) per attack and batch, and the seconds.

    python benchmarks/fedleak.py [--batch 8] [--iterations 300] [--width 8] [--partial 0.5] [--rho 1e-3] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from leakaudit.attacks.fedleak import FedLeak
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.zoo.datasets import _foolbox_loader
from leakaudit.evaluator.zoo.metrics import best_assignment, psnr
from leakaudit.evaluator.zoo.models import resnet20
from leakaudit.plugins.attack import Attack, Problem, ThreatModel
from leakaudit.plugins.protocol import FEDSGD, ClientStep


def photos(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All 20 photos of a foolbox sample set (train and test halves), in [0, 1], with their labels."""
    data = _foolbox_loader(name)(image_size=32)
    return torch.cat([data.train_x, data.test_x]), torch.cat([data.train_y, data.test_y])


def attacks(iterations: int, partial: float, rho: float) -> dict[str, Attack]:
    """The four attacks compared, by the name printed."""
    return {"inverting_gradients": InvertingGradients(iterations=iterations),
            "fedleak partial": FedLeak(iterations=iterations, partial=partial, gradient_regularization=0.0),
            "fedleak rho": FedLeak(iterations=iterations, partial=1.0, gradient_regularization=rho),
            "fedleak both": FedLeak(iterations=iterations, partial=partial, gradient_regularization=rho)}


def run(batch: int, iterations: int, width: int, partial: float, rho: float, seed: int = 0) -> dict[str, list[float]]:
    """Mean PSNR per attack and target batch."""
    x, y = photos("cifar10_samples")
    population, _ = photos("cifar100_samples")
    mean, std = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1), torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    torch.manual_seed(seed)
    model = resnet20(3, 10, 32, width=width).train()
    with torch.no_grad():  # the running statistics of a model that has seen natural images, not the targets
        for _ in range(20):
            model((population - mean) / std)
    batches = range(len(x) // batch)
    cases = []
    for b in batches:
        pixels, labels = x[b * batch:(b + 1) * batch], y[b * batch:(b + 1) * batch]
        observed = NoDefense().share(ClientStep(model, F.cross_entropy, (pixels - mean) / std, labels,
                                                torch.Generator().manual_seed(seed + b), FEDSGD))
        threat = ThreatModel(model, F.cross_entropy, (3, 32, 32), mean, std, 10, batch, NoDefense(), labels=labels)
        cases.append((observed, threat, pixels))
    scores: dict[str, list[float]] = {}
    for name, attack in attacks(iterations, partial, rho).items():  # every batch at once, each from its seeded start
        start = time.perf_counter()
        recs = type(attack).reconstruct_all([Problem(o, t, torch.Generator().manual_seed(seed + b), attack)
                                             for b, (o, t, _) in zip(batches, cases)])
        scores[name] = [float(psnr(rec.images[best_assignment(rec.images, pixels)], pixels).mean())
                        for rec, (_, _, pixels) in zip(recs, cases)]
        print(f"{name:>19}: {' '.join(f'{s:6.2f}' for s in scores[name])} dB  {time.perf_counter() - start:6.1f} s",
              flush=True)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--partial", type=float, default=0.5)
    parser.add_argument("--rho", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scores = run(args.batch, args.iterations, args.width, args.partial, args.rho)
    for name, values in scores.items():
        print(f"{name:>19}: mean PSNR {sum(values) / len(values):6.2f} dB over {len(values)} batches of {args.batch}")


if __name__ == "__main__":
    main()
