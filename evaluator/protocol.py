"""What one client computes in one federated round: FedSGD's gradient or FedAvg's local-training delta."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Protocol:
    """How a client turns its images into an update.

    ``fedsgd``: the gradient of the mean loss over all the client's images.
    ``fedavg``: ``local_epochs`` passes over the images in order, in minibatches of
    ``local_batch_size`` (all images when None), SGD at ``local_lr``; the client
    sends ``theta_before - theta_after`` (seed 004, Sec. 6).
    """

    name: str = "fedsgd"
    local_epochs: int = 1
    local_batch_size: int | None = None
    local_lr: float = 1e-4

    def local_steps(self, images: int) -> int:
        if self.name == "fedsgd":
            return 1
        b = self.local_batch_size or images
        return self.local_epochs * -(-images // b)


FEDSGD = Protocol()


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


def fedavg_update(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, protocol: Protocol,
                  create_graph: bool = False) -> list[Tensor]:
    """``theta_before - theta_after`` of local SGD, unrolled so it can stay differentiable in ``inputs``."""
    names = parameter_names(model)
    start = dict(zip(names, trainable(model)))
    current = dict(start)
    b = protocol.local_batch_size or len(inputs)
    for _ in range(protocol.local_epochs):
        for i in range(0, len(inputs), b):
            loss = loss_fn(functional_call(model, current, (inputs[i:i + b],)), targets[i:i + b])
            grads = torch.autograd.grad(loss, list(current.values()), create_graph=create_graph)
            current = {n: p - protocol.local_lr * g for (n, p), g in zip(current.items(), grads)}
    return [start[n] - current[n] for n in names]


def client_update(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor,
                  protocol: Protocol = FEDSGD, create_graph: bool = False) -> list[Tensor]:
    """The clean update of ``protocol`` for this batch."""
    if protocol.name == "fedavg":
        return fedavg_update(model, loss_fn, inputs, targets, protocol, create_graph)
    return fedsgd_update(model, loss_fn, inputs, targets, create_graph)


@dataclass
class ClientStep:
    """One client's round: its model, loss, private batch, protocol and a seeded generator for the defense."""

    model: nn.Module
    loss_fn: LossFn
    inputs: Tensor
    labels: Tensor
    generator: torch.Generator
    protocol: Protocol = field(default=FEDSGD)

    def clean_update(self) -> list[Tensor]:
        """The update before any defense touches it."""
        return [g.detach() for g in client_update(self.model, self.loss_fn, self.inputs, self.labels, self.protocol)]
