"""A leakaudit plugin template: one defense, registered through the ``register_defenses`` hook.

Copy this folder, rename the package and the entry point, and replace the defense.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from leakaudit import Defense, Param, SharedUpdate, hookimpl


class LogisticNoise(Defense):
    """Adds i.i.d. Logistic(0, scale) noise to every coordinate of the shared update."""

    name = "logistic"
    params = {"scale": Param(type=float, min=0.0, exclusive_min=True, help="scale of the logistic noise")}

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        out = []
        for g in update:
            u = torch.rand(g.shape, generator=generator, device=g.device, dtype=g.dtype).clamp(1e-7, 1 - 1e-7)
            out.append(g + self.scale * (torch.log(u) - torch.log1p(-u)))
        return out

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """Sum of logistic log-densities of the residuals, up to a constant: -z - 2 softplus(-z)."""
        total = 0.0
        for o, c in zip(observed.tensors, candidate):
            z = (o - c) / self.scale
            total = total + (-z - 2 * F.softplus(-z)).sum()
        return total


@hookimpl
def register_defenses():
    return [LogisticNoise]
