"""Norm clipping of the whole update."""
from __future__ import annotations

from typing import Sequence, cast

import torch
from torch import Tensor

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import DeterministicDefense


def clip_total_norm(update: Sequence[Tensor], max_norm: float) -> list[Tensor]:
    """Scale the update so that its L2 norm over all tensors is at most ``max_norm`` (differentiable)."""
    norm = torch.sqrt(cast(Tensor, sum((g ** 2).sum() for g in update)))
    factor = torch.clamp(max_norm / (norm + 1e-12), max=1.0)
    return [g * factor for g in update]


class Clip(DeterministicDefense):
    """Scales the update down to L2 norm ``max_norm`` (over all tensors) when it is larger."""

    name = "clip"
    paper = "Abadi et al. 2016"
    params = {"max_norm": Param(type=float, min=0.0, exclusive_min=True, help="largest L2 norm sent",
                                 example=1.0)}
    max_norm: float

    def transform(self, update: Sequence[Tensor]) -> list[Tensor]:
        return clip_total_norm(update, self.max_norm)

    def output_radius(self, radius: float | None) -> float | None:
        return self.max_norm if radius is None else min(radius, self.max_norm)


@hookimpl
def register_defenses():
    return [Clip]
