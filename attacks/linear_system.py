"""Each layer's input as the unknown of a linear system (R-GAP; seed 002, Sec. 3).

For a convolution ``z = W * x`` (bias moved to the left) the forward pass gives ``W_circ x = z``
and the backward pass ``dL/dW = G(delta) x``, with ``delta = dL/dz``: both are linear in ``x``.
Stacked, they form ``A x = [z; dL/dW]``. Its rank deficiency ``rank(A) - |x|`` (zero or
negative) says how much of the layer's input the two passes cannot pin down, and seed 002's
security metric (Definition 3.3) is its position-weighted average over the ``L``
convolutional layers, ``(1/L) sum_i (L - i + 1) rd_i``, so an early loss counts most. A
fully connected layer with a bias gives its input exactly and does not enter the metric.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import jacfwd

#: Elementwise activations the layer-wise systems can look through.
ACTIVATIONS = (nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ReLU, nn.Identity)


@dataclass
class LayerSystem:
    """One convolutional layer's linear system ``A x = b`` in its input ``x``."""

    name: str
    matrix: Tensor  # (|z| + |W|, |x|)
    rhs: Tensor
    input_shape: tuple[int, ...]

    @property
    def unknowns(self) -> int:
        return self.matrix.shape[1]

    def rank_deficiency(self) -> int:
        """``rank(A) - |x|``: zero when the two passes determine the input."""
        return numerical_rank(self.matrix) - self.unknowns


def numerical_rank(matrix: Tensor) -> int:
    """Rank from the eigenvalues of the smaller Gram matrix (a few times faster than an SVD of ``matrix``).

    An eigenvalue counts when it exceeds ``lambda_max * max(m, n) * eps``, the Gram matrix's own
    rounding level: singular values below ``sigma_max * sqrt(max(m, n) * eps)`` (about 1e-6
    relative in float64) are taken as zero.
    """
    m, n = matrix.shape
    gram = matrix @ matrix.T if m < n else matrix.T @ matrix
    eigenvalues = torch.linalg.eigvalsh(gram)
    tolerance = eigenvalues.max() * max(m, n) * torch.finfo(matrix.dtype).eps
    return int((eigenvalues > tolerance).sum())


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model as a chain of Conv2d, activations, Flatten and Linear, or ValueError naming what is not."""
    if not isinstance(model, nn.Sequential):
        raise ValueError("the layer-wise linear systems need an nn.Sequential of Conv2d, elementwise activations, "
                         f"Flatten and Linear layers; got {type(model).__name__}")
    chain = list(model.named_children())
    for name, m in chain:
        if isinstance(m, nn.Conv2d) and (m.groups != 1 or m.dilation != (1, 1)):
            raise ValueError(f"layer {name}: grouped or dilated convolutions are not supported")
        if not isinstance(m, (nn.Conv2d, nn.Linear, nn.Flatten, *ACTIVATIONS)):
            raise ValueError(f"layer {name} ({type(m).__name__}) is not a Conv2d, Linear, Flatten or one of "
                             f"{', '.join(a.__name__ for a in ACTIVATIONS)}")
    return chain


def conv_systems(model: nn.Module, loss_fn, image: Tensor, label: Tensor) -> list[LayerSystem]:
    """The linear system of every convolutional layer for one image, in float64."""
    convs = [(n, m) for n, m in layers_of(model) if isinstance(m, nn.Conv2d)]
    inputs, outputs = {}, {}

    def keep(name: str):
        def hook(module, args, out) -> None:
            inputs[name], outputs[name] = args[0], out
        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in convs]
    try:
        with torch.enable_grad():
            loss = loss_fn(model(image), label)
            deltas = torch.autograd.grad(loss, [outputs[n] for n, _ in convs])
    finally:
        for h in hooks:
            h.remove()
    systems = []
    for (name, conv), delta in zip(convs, deltas):
        x = inputs[name].detach().double()
        w, d = conv.weight.detach().double(), delta.detach().double()
        opts = dict(stride=conv.stride, padding=conv.padding)

        def passes(flat: Tensor) -> Tensor:
            xi = flat.view(x.shape)
            forward = F.conv2d(xi, w, None, **opts)
            gradient = torch.nn.grad.conv2d_weight(xi, w.shape, d, **opts)
            return torch.cat([forward.reshape(-1), gradient.reshape(-1)])

        flat = x.reshape(-1)
        systems.append(LayerSystem(name, jacfwd(passes)(flat), passes(flat), tuple(x.shape[1:])))
    return systems


def security_metric(deficiencies: list[int]) -> float:
    """Seed 002's metric: ``(1/L) sum_i (L - i + 1) rd_i`` over the convolutional layers (i from 1)."""
    n = len(deficiencies)
    return sum((n - i) * rd for i, rd in enumerate(deficiencies)) / n if n else 0.0
