"""Compression that federated deployments put on the update: signSGD.

It was not made to protect privacy, but it is what many deployments send, so an audit must know what an
attacker who knows the compression can still read; it declares its likelihood so that ``bayes`` uses it.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import DeterministicDefense, SharedUpdate


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


@hookimpl
def register_defenses():
    return [SignSGD]
