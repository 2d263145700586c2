"""The logistic defense for leakaudit: i.i.d. logistic noise on every coordinate of the shared update.

Replace the noise with your defense; keep ``log_likelihood`` exactly the density of what ``perturb``
sends (up to a constant in the candidate), because the Bayes-optimal attacker maximises it.
``tests/`` checks the two against each other with ``leakaudit.testing.check_defense``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from leakaudit import Defense, Param, SharedUpdate, hookimpl


class LogisticDefense(Defense):
    """Adds i.i.d. Logistic(0, scale) noise to every coordinate of the shared update."""

    name = "logistic"
    paper = ""  # the paper your defense comes from, as "Author et al. YEAR"; `leakaudit plugins` shows it
    params = {"scale": Param(type=float, min=0.0, exclusive_min=True, example=0.1, help="scale of the logistic noise")}

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        """Every random number comes from ``generator``: the same seed sends the same update."""
        out = []
        for g in update:
            u = torch.rand(g.shape, generator=generator, device=g.device, dtype=g.dtype).clamp(1e-7, 1 - 1e-7)
            out.append(g + self.scale * (torch.log(u) - torch.log1p(-u)))
        return out

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """The logistic log-density of the residuals, summed, up to a constant: -z - 2 softplus(-z)."""
        total = 0.0
        for o, c in zip(observed.tensors, candidate):
            z = (o - c) / self.scale
            total = total + (-z - 2 * F.softplus(-z)).sum()
        return total


@hookimpl
def register_defenses():
    return [LogisticDefense]
