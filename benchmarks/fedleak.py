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
import sys
from pathlib import Path

import torch

from leakaudit.attacks.fedleak import FedLeak
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.plugins.attack import Attack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batchnorm_prior import cases, scored  # noqa: E402  (a sibling script, not a package)


def attacks(iterations: int, partial: float, rho: float) -> dict[str, Attack]:
    """The four attacks compared, by the name printed."""
    return {"inverting_gradients": InvertingGradients(iterations=iterations),
            "fedleak partial": FedLeak(iterations=iterations, partial=partial, gradient_regularization=0.0),
            "fedleak rho": FedLeak(iterations=iterations, partial=1.0, gradient_regularization=rho),
            "fedleak both": FedLeak(iterations=iterations, partial=partial, gradient_regularization=rho)}


def run(batch: int, iterations: int, width: int, partial: float, rho: float, seed: int = 0) -> dict[str, list[float]]:
    """Mean PSNR per attack and target batch."""
    return scored(attacks(iterations, partial, rho), cases(batch, width, seed), seed)


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
