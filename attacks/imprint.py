"""The malicious server of Fowl et al. 2022 ("Robbing the Fed"): an imprint block it places in front of the
model, and the attack that reads individual images out of the block's gradients, exactly, even from the mean
of many clients' updates under secure aggregation.

The block has ``bins`` ReLU units that all measure the input along one random direction, each above its own
threshold (thresholds at the quantiles of a standard normal, so the measurements of normalised images fall
about evenly into the bins), and adds their outputs back onto the input through equal weights, so that
every unit passes on the same gradient for one image. Unit ``i``'s weight gradient is then the sum of
``c_n x_n`` over the images measured above threshold ``i``, and its bias gradient the sum of ``c_n``: the
difference between consecutive units, divided by the difference of their biases' gradients, is the image
alone between the two thresholds. It holds for any sum of such gradients (a batch, a mean over clients, one
local SGD step), which is why secure aggregation does not stop it. Several local steps (FedAvg over minibatches)
sum gradients taken at weights that moved in between: the reading holds to first order in the local learning
rate, and the images come back the fewer the larger it is (tests/test_imprint.py measures both).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from leakaudit.attacks.gradient_matching import LABEL_METHOD
from leakaudit.attacks.labels import recover_labels
from leakaudit.plugins import hookimpl
from leakaudit.plugins.attack import Attack, Reconstruction, ThreatModel, MALICIOUS_SERVER
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import Protocol

#: A bin whose bias gradient is below this share of the largest one holds no image (rounding only).
EMPTY = 1e-6


class ImprintBlock(nn.Module):
    """Fowl et al.'s (2022) imprint module: ``bins`` thresholded measurements of the input along one random
    direction (drawn from the global generator, which model building seeds), added back onto the input."""

    def __init__(self, channels: int, image_size: int, bins: int) -> None:
        super().__init__()
        size = channels * image_size * image_size
        self.shape = (channels, image_size, image_size)
        self.measure = nn.Linear(size, bins)
        self.spread = nn.Linear(bins, size, bias=False)
        with torch.no_grad():
            direction = torch.randn(size)
            self.measure.weight.copy_((direction / direction.norm()).expand(bins, size))
            levels = torch.arange(1, bins + 1, dtype=torch.float64) / (bins + 1)
            self.measure.bias.copy_(-torch.distributions.Normal(0.0, 1.0).icdf(levels).float())  # ascending
            self.spread.weight.fill_(1.0 / bins)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.spread(torch.relu(self.measure(x.flatten(1)))).view(-1, *self.shape)


def imprint_block(model: nn.Module) -> tuple[str, ImprintBlock] | None:
    """The model's imprint block and its name (None when the server placed none)."""
    return next(((name, m) for name, m in model.named_modules() if isinstance(m, ImprintBlock)), None)


def binned_images(weight_grad: Tensor, bias_grad: Tensor, count: int) -> Tensor:
    """Up to ``count`` inputs read from an imprint block's gradients, the fullest bins first, flat: (k, size)."""
    rows = torch.cat([weight_grad[:-1] - weight_grad[1:], weight_grad[-1:]])
    mass = torch.cat([bias_grad[:-1] - bias_grad[1:], bias_grad[-1:]])
    order = mass.abs().argsort(descending=True)[:count]
    order = order[mass[order].abs() > EMPTY * mass.abs().max()]
    return rows[order] / mass[order, None]


class Imprint(Attack):
    """The images out of an imprint block's gradients, one per filled bin (Fowl et al. 2022). The images no bin
    isolates (two in one bin, or one under the lowest threshold) come back as the data's mean image."""
    attacker = MALICIOUS_SERVER

    name = "imprint"
    paper = "Fowl et al. 2022"
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {}}
    brings = "a malicious server's imprint block (model: imprint), where the threat model allows one"
    params = {"label_method": LABEL_METHOD}
    label_method: str

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if imprint_block(model) is None:
            return ("imprint reads the gradients of an imprint block the malicious server places in front of the "
                    "model; audit it with model: {name: imprint, params: {base: ...}}")
        return None

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        located = imprint_block(threat.model)
        assert located is not None  # unsupported() refuses a model without the block
        name, block = located
        grads = dict(zip(observed.names, observed.tensors))
        found = binned_images(grads[f"{name}.measure.weight"].to(threat.device),
                              grads[f"{name}.measure.bias"].to(threat.device), threat.batch_size)
        images = torch.zeros((threat.batch_size, *block.shape), device=threat.device)  # the mean image, normalised
        images[:len(found)] = found.view(-1, *block.shape)
        labels = recover_labels(observed, threat, self.label_method, generator)
        return Reconstruction(threat.to_pixels(images), labels, [], 0.0, {"bins_filled": len(found)})


@hookimpl
def register_attacks():
    return [Imprint]
