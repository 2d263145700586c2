"""Additive-noise defenses and the undefended baseline."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from defenses.base import Defense, SharedUpdate
from plugins import Param, hookimpl


def squared_distance(observed: Sequence[Tensor], candidate: Sequence[Tensor]) -> Tensor:
    """Sum over all tensors of the squared Euclidean distance."""
    return sum(((o - c) ** 2).sum() for o, c in zip(observed, candidate))


class NoDefense(Defense):
    """Shares the clean update: the reference point of every audit."""

    name = "none"

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """The observation is exact; -||g - g(x)||^2 / 2 keeps its maximiser (the zero-noise limit)."""
        return -0.5 * squared_distance(observed.tensors, candidate)


class GaussianNoise(Defense):
    """Adds independent N(0, sigma^2) noise to every coordinate of the update."""

    name = "gaussian"
    params = {"sigma": Param(type=float, min=0.0, exclusive_min=True, help="noise standard deviation")}

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        return [g + self.sigma * torch.randn(g.shape, generator=generator, device=g.device, dtype=g.dtype)
                for g in update]

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """Gaussian log-density of the observed noise, up to the normalising constant."""
        return -squared_distance(observed.tensors, candidate) / (2 * self.sigma ** 2)


@hookimpl
def register_defenses():
    return [NoDefense, GaussianNoise]
