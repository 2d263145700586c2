"""What one client computes in one federated round (FedSGD: the gradient of its batch loss)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

LossFn = Callable[[Tensor, Tensor], Tensor]


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a client shares, in the model's order."""
    return [p for p in model.parameters() if p.requires_grad]


def parameter_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def fedsgd_update(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor,
                  create_graph: bool = False) -> list[Tensor]:
    """The FedSGD update: gradient of the mean batch loss for every trainable parameter.

    With ``create_graph=True`` the result stays differentiable in ``inputs`` (and in
    soft ``targets``), which is what gradient-matching attacks optimise through.
    """
    loss = loss_fn(model(inputs), targets)
    return list(torch.autograd.grad(loss, trainable(model), create_graph=create_graph))


@dataclass
class ClientStep:
    """One client's round: its model, loss, private batch and a seeded generator for the defense."""

    model: nn.Module
    loss_fn: LossFn
    inputs: Tensor
    labels: Tensor
    generator: torch.Generator

    def clean_update(self) -> list[Tensor]:
        """The update before any defense touches it."""
        return [g.detach() for g in fedsgd_update(self.model, self.loss_fn, self.inputs, self.labels)]
