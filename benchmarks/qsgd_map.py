"""Why the Bayes adversary needs a prior on QSGD: where its estimator lands without one, against the truth.

For one digit on the untrained lenet_zhu (32 px), the update is quantised by ``qsgd`` and attacked by plain
Adam (1,000 steps, lr 0.1 decaying to 0.01, no prior) on minus QSGD's log-likelihood, two ways:

- ``bayes``: as the attack does (the exact triangles, continued by tangents outside them);
- ``annealed``: the same, with the tangents' floor lowered from 1 to its default over the first half, a
  barrier method's continuation that lets the optimiser reach the inside of every triangle.

It prints each result's log-likelihood beside the true image's, and its mean squared error to the truth.
A result above the truth's log-likelihood but farther from the truth means the maximum a posteriori itself
lies away from the image: the estimator fits the quantisation's noise, and no optimiser would fix that.

    python benchmarks/qsgd_map.py [--levels 32] [--iterations 1000]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from leakaudit.defenses import compression
from leakaudit.defenses.compression import QSGD
from leakaudit.evaluator.zoo.datasets import load_digits
from leakaudit.evaluator.zoo.models import lenet_zhu
from leakaudit.plugins.defense import SharedUpdate


def attack(objective: str, gradient, likelihood, start: torch.Tensor, iterations: int) -> torch.Tensor:
    """Adam on ``objective`` from ``start``; the image it ends at."""
    x = start.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([x], lr=0.1)
    decay = torch.optim.lr_scheduler.ExponentialLR(optimiser, 0.1 ** (1 / iterations))
    floor = compression.KERNEL_FLOOR
    for i in range(iterations):
        if objective == "annealed":
            compression.KERNEL_FLOOR = floor ** min(1.0, i / (0.5 * iterations))
        candidate = gradient(x, create_graph=True)
        loss = -likelihood(candidate)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        decay.step()
    compression.KERNEL_FLOOR = floor
    return x.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = load_digits(32)
    x0, y0 = data.test_x[:1], data.test_y[:1]
    model = lenet_zhu(1, 10, 32)
    params = list(model.parameters())

    def gradient(x: torch.Tensor, create_graph: bool = False) -> list[torch.Tensor]:
        return list(torch.autograd.grad(F.cross_entropy(model(x), y0), params, create_graph=create_graph))

    defense = QSGD(levels=args.levels)
    sent, public = defense.apply([g.detach() for g in gradient(x0)], torch.Generator().manual_seed(1))
    observed = SharedUpdate(sent, [str(i) for i in range(len(sent))], 1, public)

    def likelihood(candidate: list[torch.Tensor]) -> torch.Tensor:
        return defense.log_likelihood(observed, candidate)

    print(f"qsgd levels {args.levels}: the true image's log-likelihood {float(likelihood(gradient(x0))):.1f}")
    start = torch.randn_like(x0)
    for objective in ("bayes", "annealed"):
        x = attack(objective, gradient, likelihood, start, args.iterations)
        value = float(likelihood([g.detach() for g in gradient(x)]))
        print(f"{objective:>9}: log-likelihood {value:.1f}, mean squared error to the truth "
              f"{float(((x - x0) ** 2).mean()):.3f}")


if __name__ == "__main__":
    main()
