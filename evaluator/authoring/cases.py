"""The tiny case the plugin checks run on by default: a 64-32-10 MLP and 8x8 digits, seeded."""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leakaudit.evaluator.live.api import live_threat
from leakaudit.evaluator.zoo.datasets import load_digits
from leakaudit.evaluator.zoo.models import mlp
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.defense import Defense
from leakaudit.plugins.protocol import Protocol


def tiny_case(images: int = 2, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """A one-hidden-layer MLP (64 -> 32 -> 10) and ``images`` of scikit-learn's 8x8 digits in [0, 1], seeded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = mlp(1, 10, 8, width=32, depth=1)
    data = load_digits(8)
    return model, data.test_x[:images].clone(), data.test_y[:images].clone()


def case_or_tiny(model: nn.Module | None, batch: tuple[Tensor, Tensor] | None, images: int,
          seed: int) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """The caller's model and batch, ``tiny_case``'s where one is not given (built only then)."""
    if model is None or batch is None:
        tiny_model, x, y = tiny_case(images, seed)
        model, batch = model if model is not None else tiny_model, batch if batch is not None else (x, y)
    return model, batch


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def check_threat(model: nn.Module, inputs: Tensor, labels: Tensor, defense: Defense, protocol: Protocol,
            known_labels: bool) -> ThreatModel:
    """The honest-but-curious server of the tiny case: inputs are pixels (mean 0, std 1), or token ids."""
    zeros = torch.zeros(inputs.shape[1] if inputs.is_floating_point() else 1, 1, 1, device=inputs.device)
    return live_threat(model, F.cross_entropy, inputs, labels, zeros, zeros + 1, defense, known_labels, protocol)
