"""PRECODE (Scheliga et al. 2022): a variational bottleneck inserted before a fully connected layer.

The block encodes its input to a mean and a scale, draws a fresh sample
``b = mu + scale * eps`` every forward pass and decodes it back to the input's size;
training adds ``kl_weight`` times the KL divergence of N(mu, scale^2) from N(0, 1).
Everything before the block is deterministic, so the analytic inversion of a first fully
connected layer still applies (Balunovic et al. 2022, Sec. 5), and for one image the decoder's
weight and bias gradients give the sample ``b`` itself (``attacks.precode``).
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator, cast

import torch.nn.functional as F
from torch import Tensor, nn

from leakaudit.defenses.layers import fully_connected_layer
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import Defense
from leakaudit.plugins.protocol import LossFn
from leakaudit.plugins.stochastic import StochasticModule, with_kl

#: PRECODE's reference shifts the scale's pre-activation by -5, so training starts with little noise.
SCALE_SHIFT = 5.0


class VariationalBottleneck(StochasticModule):
    """Encoder to (mu, scale), a fresh sample every forward pass, decoder back to ``features``."""

    def __init__(self, features: int, size: int) -> None:
        super().__init__()
        self.size = size
        self.encoder = nn.Linear(features, 2 * size)
        self.decoder = nn.Linear(size, features)
        # a known sample: the noise becomes (pinned - mu) / scale, held constant; a buffer (not saved with the
        # weights) so that per-problem samples can be stacked and substituted by torch.func.functional_call
        self.register_buffer("pinned", None, persistent=False)

    @property
    def draws_noise(self) -> bool:
        return self.pinned is None

    def statistics(self, x: Tensor) -> tuple[Tensor, Tensor]:
        stats = self.encoder(x.flatten(1))
        return stats[:, :self.size], F.softplus(stats[:, self.size:] - SCALE_SHIFT)

    def forward(self, x: Tensor) -> Tensor:
        mu, scale = self.statistics(x)
        pinned = cast("Tensor | None", self.pinned)  # a buffer: Module's attribute typing cannot say so
        if pinned is None:
            eps = self.standard_normal(tuple(mu.shape), mu)
        else:
            eps = ((pinned - mu) / scale).detach()
        self._kl_term = lambda: 0.5 * (mu ** 2 + scale ** 2 - 2 * scale.log() - 1).sum(dim=1).mean()
        return self.decoder(mu + scale * eps).view(x.shape)


def bottleneck_of(model: nn.Module) -> VariationalBottleneck | None:
    return next((m for m in model.modules() if isinstance(m, VariationalBottleneck)), None)


@contextmanager
def pinned_sample(model: nn.Module, sample: Tensor) -> Iterator[None]:
    """Inside the block the model's bottleneck uses ``sample`` as its draw (and stays differentiable)."""
    block = bottleneck_of(model)
    if block is None:
        raise ValueError("pinned_sample: the model has no PRECODE bottleneck (defense precode)")
    block.pinned = sample
    try:
        yield
    finally:
        setattr(block, "pinned", None)  # the buffer emptied (Module's typing takes only tensors and modules)


class Precode(Defense):
    """Inserts a variational bottleneck before a fully connected layer; trains with its KL term."""

    name = "precode"
    modalities = ("image",)  # its attacks are the image ones; not yet built or checked for text models
    paper = "Scheliga et al. 2022"
    params = {
        "size": Param(256, int, min=1, help="bottleneck size K"),
        "kl_weight": Param(1e-3, float, min=0.0, protects="higher", help="weight beta of the KL term in the client's loss"),
        "position": Param("last", str, help="the fully connected layer the bottleneck goes before: "
                                            "a module name, or 'last'"),
    }
    size: int
    kl_weight: float
    position: str

    def wrap_model(self, model: nn.Module) -> nn.Module:
        name = fully_connected_layer(model, self.position, "precode", "position", "last")
        layer = cast(nn.Linear, model.get_submodule(name))  # fully_connected_layer found a Linear
        block = VariationalBottleneck(layer.in_features, self.size).to(layer.weight.device)
        model.set_submodule(name, nn.Sequential(OrderedDict(bottleneck=block, layer=layer)))
        self.model_changes = [f"{name}: variational bottleneck of size {self.size} inserted before it "
                              f"({layer.in_features} -> 2x{self.size} -> {self.size} -> {layer.in_features})"]
        return model

    def client_loss(self, model: nn.Module, loss_fn: LossFn) -> LossFn:
        return with_kl(model, loss_fn, self.kl_weight)


@hookimpl
def register_defenses():
    return [Precode]
