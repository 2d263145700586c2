"""fedavg_epochs against Inverting Gradients' in-order unrolling on one FedAvg client whose batch order is unknown:
2 local epochs over 4 batches of 16 (64 images), the client shuffling its images every epoch.

Case: Fashion-MNIST test images (Debian's dataset-fashion-mnist) at ``--size`` px; the zoo's ``mlp`` (two hidden
ReLU layers of 256 units), untrained; protocol ``fedavg`` with ``local_epochs`` ``--epochs`` (2),
``local_batch_size`` 16, ``local_lr`` ``--lr`` and ``shuffle: true``; labels recovered from the update (not
given). Each attack's reconstructions are matched to the originals (least MSE) and scored as the project scores a
batch: mean PSNR against the class means' (each original's class mean over the training split, the no-gradient
guess), and the decoy test (each original named among 8 same-class decoys beyond chance, docs/verdicts.md).
Prints one row per attack with the figures and the seconds.

    python benchmarks/fedavg_epochs.py [--images 64] [--iterations 400] [--lr 0.1] [--epochs 2] [--invariant 1]
                                       [--threads 2]
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from leakaudit.attacks.fedavg_epochs import FedAvgEpochs
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.results.verdict import decoy_groups, decoy_test
from leakaudit.evaluator.zoo.datasets import load_fashion_mnist
from leakaudit.evaluator.zoo.metrics import best_assignment
from leakaudit.evaluator.zoo.models import mlp
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import ClientStep, FedAvg


@dataclass
class Case:
    """One shuffled FedAvg client's update, what the attacker knows, and what scoring needs."""

    observed: SharedUpdate
    threat: ThreatModel
    pixels: Tensor
    labels: Tensor
    class_means: Tensor
    decoys: Tensor
    decoy_labels: Tensor


def shuffled_case(images: int, size: int, lr: float, epochs: int = 2, batch: int = 16, seed: int = 0) -> Case:
    """``images`` Fashion-MNIST test images sent through a shuffling FedAvg client of the untrained zoo mlp."""
    data = load_fashion_mnist(image_size=size)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    generator = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(data.test_x), generator=generator)
    pixels, labels = data.test_x[pick[:images]], data.test_y[pick[:images]]
    torch.manual_seed(seed)
    model = mlp(1, 10, size)
    protocol = FedAvg(local_epochs=epochs, local_batch_size=batch, local_lr=lr, shuffle=True)
    observed = NoDefense().share(ClientStep(model, F.cross_entropy, (pixels - mean) / std, labels,
                                            torch.Generator().manual_seed(seed + 1), protocol))
    threat = ThreatModel(model, F.cross_entropy, (1, size, size), mean, std, 10, images, NoDefense(),
                         protocol=protocol)
    class_means = torch.stack([data.train_x[data.train_y == c].mean(0) for c in range(10)])
    rest = pick[images:images + 2000]
    return Case(observed, threat, pixels, labels, class_means[labels], data.test_x[rest], data.test_y[rest])


def psnr(a: Tensor, b: Tensor) -> Tensor:
    """Per image PSNR in dB of pixel images in [0, 1]."""
    return -10 * torch.log10(((a - b) ** 2).flatten(1).mean(1).clamp_min(1e-10))


def score(case: Case, reconstruction: Tensor) -> dict[str, float]:
    """Mean PSNR of the matched reconstructions, the class means' mean PSNR, and the decoy test."""
    recs = reconstruction[best_assignment(reconstruction, case.pixels)]
    own = ((recs[:, None] - case.pixels[None]) ** 2).flatten(2).mean(2).numpy()
    groups = decoy_groups(case.labels.numpy(), case.decoy_labels.numpy())
    used = sorted({d for g in groups for d in g})
    where = {d: i for i, d in enumerate(used)}
    near = ((recs[:, None] - case.decoys[used][None]) ** 2).flatten(2).mean(2).numpy()
    hits, total, p = decoy_test([own], [near], [[[where[d] for d in g] for g in groups]])
    return {"psnr": float(psnr(recs, case.pixels).mean()), "class_means": float(psnr(case.class_means,
                                                                                     case.pixels).mean()),
            "named": hits, "of": total, "p": p}


def run(case: Case, iterations: int, invariant: float) -> list[tuple[str, dict[str, float], float]]:
    """Each attack's scores and seconds on the case, the same seed for both."""
    rows = []
    for attack in (FedAvgEpochs(iterations=iterations, invariant=invariant), InvertingGradients(iterations=iterations)):
        start = time.perf_counter()
        rec = attack(case.observed, case.threat, torch.Generator().manual_seed(2))
        rows.append((attack.name, score(case, rec.images), time.perf_counter() - start))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=FedAvgEpochs.auto_params["cpu"]["iterations"])
    parser.add_argument("--lr", type=float, default=0.1, help="the client's local SGD step size")
    parser.add_argument("--epochs", type=int, default=2, help="the client's local epochs")
    parser.add_argument("--invariant", type=float, default=FedAvgEpochs.params["invariant"].default,
                        help="fedavg_epochs' weight of the epoch-order-invariant prior (0: copies left free)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    case = shuffled_case(args.images, args.size, args.lr, epochs=args.epochs)
    print(f"{args.images} Fashion-MNIST images at {args.size} px, untrained mlp, fedavg {args.epochs} epochs x "
          f"{args.images // 16} batches of 16 at lr {args.lr}, shuffled; {args.iterations} iterations, invariant prior "
          f"{args.invariant}, {args.threads} threads")
    print("| attack | mean PSNR (dB) | class means (dB) | named among decoys | p | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, s, seconds in run(case, args.iterations, args.invariant):
        print(f"| {name} | {s['psnr']:.2f} | {s['class_means']:.2f} | {s['named']} of {s['of']} | "
              f"{s['p']:.1e} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
