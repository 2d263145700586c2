"""A small federated client of your own, audited by leakaudit as it trains.

It trains a CNN on scikit-learn's handwritten digits with its own SGD step, the
step that runs on every client in every round. ``audit.yaml`` beside this file
audits the same step from YAML (``leakaudit run audit.yaml``); running this file
audits it from Python with ``leakaudit.audit_batch`` inside the training loop.

    python examples/own_training/digits_client.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leakaudit import ImageData, audit_batch

LR = 0.05          # the step size of train_step below
IMAGE_SIZE = 16
ATTACKS = [{"name": "inverting_gradients", "params": {"iterations": 300}}]  # as in audit.yaml


def build_model(num_classes: int = 10, seed: int = 0) -> nn.Module:
    """The client's network, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(32 * (IMAGE_SIZE // 4) ** 2, num_classes))


def load_data(image_size: int = IMAGE_SIZE) -> ImageData:
    """scikit-learn's 1797 digits in [0, 1], upsampled to ``image_size``, split 80/20 with a fixed shuffle."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", antialias=True).clamp(0, 1)
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    test, train = order[:360], order[360:]
    return ImageData("sklearn digits", x[train], y[train], x[test], y[test], num_classes=10)


def train_step(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> None:
    """One local SGD step at ``LR`` on normalised ``inputs``: what the client runs every round."""
    model.zero_grad()
    F.cross_entropy(model(inputs), labels).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad


def main(rounds: int = 200, audit_every: int = 100) -> None:
    data = load_data()
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    model = build_model()
    batches = torch.Generator().manual_seed(0)
    for round_ in range(rounds + 1):
        idx = torch.randint(len(data.train_x), (1,), generator=batches)
        inputs, labels = (data.train_x[idx] - mean) / std, data.train_y[idx]
        if round_ % audit_every == 0:
            for result in audit_batch(model, F.cross_entropy, inputs, labels, step_fn=train_step, lr=LR,
                                      mean=data.mean, std=data.std, attacks=ATTACKS, step=round_):
                print(f"round {round_}: {result.attack} rebuilds the client's image at "
                      f"{result.metrics['psnr']:.1f} dB PSNR (label accuracy {result.metrics['label_accuracy']:.0%})")
        train_step(model, inputs, labels)


if __name__ == "__main__":
    main()
