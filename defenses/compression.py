"""Compression that federated deployments put on the update: signSGD and stochastic quantisation (QSGD).

It was not made to protect privacy, but it is what many deployments send, so an audit must know what an
attacker who knows the compression can still read; it declares its likelihood so that ``bayes`` uses it.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import Defense, DeterministicDefense, SharedUpdate

#: Where a kernel's value falls below this, its log continues as its tangent there: concave, with a slope back
#: towards the support, so that an attacker starting outside it is led in (the exact log-likelihood is -inf there).
KERNEL_FLOOR = 1e-3


class SignSGD(DeterministicDefense):
    """Each coordinate's sign (Bernstein et al. 2018), scaled by the tensor's mean magnitude by default (the
    scaled sign of Karimireddy et al. 2019), so that the update keeps its size.

    The likelihood is the zero-noise limit that ``DeterministicDefense`` takes, written for signs: a squared
    hinge on every coordinate whose candidate sign disagrees with the one sent, plus the squared gap between
    the sent and the candidate scales; its maximisers are exactly the updates that send the same.
    """

    name = "signsgd"
    paper = "Bernstein et al. 2018"
    params = {"scaled": Param(True, bool, help="multiply each tensor's signs by its mean absolute value")}
    scaled: bool

    def transform(self, update: Sequence[Tensor]) -> list[Tensor]:
        return [t.sign() * (t.abs().mean() if self.scaled else 1) for t in update]

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        total = candidate[0].new_zeros(())
        for sent, c in zip(observed.tensors, candidate):
            sign = sent.sign()  # 0 where the update was exactly 0: the candidate must be 0 there too
            total = total - 0.5 * torch.where(sign == 0, c, torch.relu(-sign * c)).pow(2).sum()
            if self.scaled:  # every sent coordinate but the zeros carries the scale
                total = total - 0.5 * c.numel() * (sent.abs().max() - c.abs().mean()) ** 2
        return total


def log_kernel(value: Tensor) -> Tensor:
    """``log(value)`` where ``value >= KERNEL_FLOOR``, continued below it by its tangent (linear, concave)."""
    inside = value.clamp_min(KERNEL_FLOOR).log()
    return torch.where(value >= KERNEL_FLOOR, inside, math.log(KERNEL_FLOOR) + value / KERNEL_FLOOR - 1)


class QSGD(Defense):
    """Stochastic quantisation (Alistarh et al. 2017): each tensor is sent as its L2 norm times, per coordinate,
    the sign and one of ``levels + 1`` levels in [0, 1], rounded up or down at random so that the update stays
    unbiased. The server learns each tensor's norm with it.

    Given the sent norms, a coordinate ``g`` between two levels ``step`` apart (``step = norm / levels``) is sent
    as the upper one with probability ``(g - lower) / step``: the likelihood of what was sent is, coordinate by
    coordinate, a triangle of half-width ``step`` around the sent value, ``max(0, 1 - |sent - g| / step)``. It is
    exact given the norms, and zero outside the triangles, so ``bounded_support`` is set and ``check_defense``
    takes its derivatives by autograd. What the norms themselves say about the candidate is left out.
    """

    name = "qsgd"
    paper = "Alistarh et al. 2017"
    bounded_support = True
    params = {"levels": Param(4, int, min=1, protects="lower", help="quantisation levels s per sign: 2s + 1 values a coordinate")}
    levels: int

    def apply(self, update: list[Tensor], generator: torch.Generator) -> tuple[list[Tensor], dict[str, Any]]:
        norms = [t.norm() for t in update]
        return [self._quantise(t, n, generator) for t, n in zip(update, norms)], {"norms": norms}

    def _quantise(self, t: Tensor, norm: Tensor, generator: torch.Generator) -> Tensor:
        """``norm * sign(t) * level / levels``, the level rounded up with probability the remainder."""
        scaled = (self.levels * t.abs() / norm.clamp_min(torch.finfo(t.dtype).tiny)).clamp_max(self.levels)
        lower = scaled.floor()
        up = torch.rand(t.shape, generator=generator, device=t.device, dtype=t.dtype) < scaled - lower
        return t.sign() * (lower + up) * norm / self.levels

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """The sum of every coordinate's log-triangle around its sent value (a tensor sent with norm 0: nothing)."""
        total = candidate[0].new_zeros(())
        for sent, c, norm in zip(observed.tensors, candidate, observed.metadata["norms"]):
            step = (norm / self.levels).to(c.dtype)
            kernel = 1 - (sent - c).abs() / step.clamp_min(torch.finfo(c.dtype).tiny)
            total = total + torch.where(norm > 0, log_kernel(kernel).sum(), 0)
        return total


@hookimpl
def register_defenses():
    return [SignSGD, QSGD]
