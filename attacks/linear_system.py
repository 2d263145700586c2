"""Each layer's input as the unknown of a linear system (R-GAP; Chen & Campbell 2022, Sec. 3).

For a convolution ``z = W * x`` (bias moved to the left) the forward pass gives ``W_circ x = z``
and the backward pass ``dL/dW = G(delta) x``, with ``delta = dL/dz``: both are linear in ``x``.
Stacked, they form ``A x = [z; dL/dW]``. Its rank deficiency ``rank(A) - |x|`` (zero or
negative) says how much of the layer's input the two passes cannot pin down, and Chen & Campbell's (2022)
security metric (Definition 3.3) is its position-weighted average over the ``L``
convolutional layers, ``(1/L) sum_i (L - i + 1) rd_i``, so an early loss counts most. A
fully connected layer with a bias gives its input exactly and does not enter the metric.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vjp
from torch.nn.grad import conv2d_weight

#: Unit vectors pushed through ``A`` at once when it is built densely.
COLUMN_CHUNK = 512

#: Elementwise activations the layer-wise systems can look through.
ACTIVATIONS = (nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ReLU, nn.Identity)


@dataclass
class ConvSystem:
    """One convolution's system ``A x = rhs`` in its input ``x`` (float64), with ``A`` matrix-free."""

    name: str
    weight: Tensor
    stride: tuple[int, int]
    padding: tuple[int, int]
    delta: Tensor  # dL/dz, (1, C_out, H', W')
    input_shape: tuple[int, ...]
    rhs: Tensor  # [z - bias; dL/dW], flattened

    @property
    def unknowns(self) -> int:
        return math.prod(self.input_shape)

    def apply(self, flat: Tensor) -> Tensor:
        """``A x``: the forward pass (no bias) and the weight gradient the input would give."""
        x = flat.view(1, *self.input_shape)
        forward = F.conv2d(x, self.weight, None, stride=self.stride, padding=self.padding)
        gradient = conv2d_weight(x, self.weight.shape, self.delta, stride=self.stride, padding=self.padding)
        return torch.cat([forward.reshape(-1), gradient.reshape(-1)])

    def adjoint(self, residual: Tensor) -> Tensor:
        """``A^T r`` (the system is linear, so the vector-Jacobian product at zero is exact)."""
        pullback = vjp(self.apply, torch.zeros(self.unknowns, dtype=residual.dtype, device=residual.device))[1]
        return pullback(residual)[0]

    @cached_property
    def matrix(self) -> Tensor:
        """``A`` as a dense (equations, unknowns) matrix: ``A`` applied to the unit vectors, a chunk at a time."""
        n, device = self.unknowns, self.weight.device
        columns = [torch.vmap(self.apply)(torch.eye(n, dtype=self.weight.dtype, device=device)[i:i + COLUMN_CHUNK])
                   for i in range(0, n, COLUMN_CHUNK)]
        return torch.cat(columns).T.contiguous()

    def rank_deficiency(self) -> int:
        """``rank(A) - |x|``: zero when the two passes determine the input."""
        return numerical_rank(self.matrix) - self.unknowns

    def input_gradient(self) -> Tensor:
        """``dL/dx`` of the convolution's input, from ``delta`` (the transposed convolution)."""
        x = torch.zeros(1, *self.input_shape, dtype=self.delta.dtype, device=self.delta.device)
        pullback = vjp(lambda v: F.conv2d(v, self.weight, None, stride=self.stride, padding=self.padding), x)[1]
        return pullback(self.delta)[0].squeeze(0)


def _gram(matrix: Tensor) -> Tensor:
    m, n = matrix.shape
    return matrix @ matrix.T if m < n else matrix.T @ matrix


def _nonzero(values: Tensor, matrix: Tensor) -> Tensor:
    """Which Gram eigenvalues count: above ``lambda_max * max(m, n) * eps``, the Gram matrix's rounding level.

    Singular values below ``sigma_max * sqrt(max(m, n) * eps)`` (about 1e-6 relative in float64)
    are taken as zero.
    """
    return values > values.max() * max(matrix.shape) * torch.finfo(matrix.dtype).eps


def numerical_rank(matrix: Tensor) -> int:
    """Rank from the eigenvalues of the smaller Gram matrix (a few times faster than an SVD)."""
    return int(_nonzero(torch.linalg.eigvalsh(_gram(matrix)), matrix).sum())


def min_norm_solution(system: ConvSystem, dense_limit: int, cg_iterations: int) -> Tensor:
    """The minimum-norm least-squares solution: dense pseudo-inverse, or CGLS from zero for large systems."""
    if system.rhs.numel() * system.unknowns <= dense_limit:
        return _dense_min_norm(system.matrix, system.rhs)
    return _cgls(system, cg_iterations)


def _dense_min_norm(a: Tensor, b: Tensor, refinements: int = 2) -> Tensor:
    m, n = a.shape
    values, vectors = torch.linalg.eigh(_gram(a))
    keep = _nonzero(values, a)
    inverse = torch.where(keep, 1 / values.clamp_min(torch.finfo(a.dtype).tiny), torch.zeros_like(values))

    def pinv(r: Tensor) -> Tensor:
        if m < n:
            return a.T @ (vectors @ (inverse * (vectors.T @ r)))
        return vectors @ (inverse * (vectors.T @ (a.T @ r)))

    x = pinv(b)
    for _ in range(refinements):  # iterative refinement: the Gram matrix squares the condition number
        x = x + pinv(b - a @ x)
    return x


def _cgls(system: ConvSystem, iterations: int, tolerance: float = 1e-10) -> Tensor:
    """Conjugate gradients on the normal equations from zero: converges to the minimum-norm solution.

    Stops once ``|A^T r|`` is ``tolerance`` times its start: beyond that, rounding feeds the null space.
    """
    b = system.rhs
    x = torch.zeros(system.unknowns, dtype=b.dtype, device=b.device)
    r = b.clone()
    s = system.adjoint(r)
    p, gamma = s.clone(), (s * s).sum()
    stop = gamma * tolerance ** 2
    for _ in range(iterations):
        q = system.apply(p)
        alpha = gamma / (q * q).sum().clamp_min(torch.finfo(b.dtype).tiny)
        x, r = x + alpha * p, r - alpha * q
        s = system.adjoint(r)
        new = (s * s).sum()
        if new <= stop:
            break
        p, gamma = s + (new / gamma) * p, new
    return x


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model as a chain of Conv2d, activations, Flatten and Linear, or ValueError naming what is not."""
    if not isinstance(model, nn.Sequential):
        raise ValueError("the layer-wise linear systems need an nn.Sequential of Conv2d, elementwise activations, "
                         f"Flatten and Linear layers; got {type(model).__name__}")
    chain = list(model.named_children())
    for name, m in chain:
        if isinstance(m, nn.Conv2d) and (m.groups != 1 or m.dilation != (1, 1) or m.padding_mode != "zeros"):
            raise ValueError(f"layer {name}: grouped, dilated or non-zero-padded convolutions are not supported")
        if not isinstance(m, (nn.Conv2d, nn.Linear, nn.Flatten, *ACTIVATIONS)):
            raise ValueError(f"layer {name} ({type(m).__name__}) is not a Conv2d, Linear, Flatten or one of "
                             f"{', '.join(a.__name__ for a in ACTIVATIONS)}")
    return chain


def conv_system(name: str, conv: nn.Conv2d, delta: Tensor, input_shape: tuple[int, ...], z: Tensor,
                weight_grad: Tensor) -> ConvSystem:
    """The system of ``conv`` given its bias-free output ``z``, ``delta = dL/dz`` and its weight gradient."""
    stride, padding = cast(tuple[int, int], conv.stride), cast(tuple[int, int], conv.padding)  # ints made pairs
    return ConvSystem(name, conv.weight.detach().double(), stride, padding, delta.double(),
                      tuple(input_shape), torch.cat([z.double().reshape(-1), weight_grad.double().reshape(-1)]))


def conv_systems(model: nn.Module, loss_fn, image: Tensor, label: Tensor) -> list[ConvSystem]:
    """The linear system of every convolutional layer for one image, from its true passes."""
    convs = [(n, m) for n, m in layers_of(model) if isinstance(m, nn.Conv2d)]
    if not convs:
        raise ValueError("the model has no convolutional layer, so there is no convolutional system to analyse")
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
        bias = 0 if conv.bias is None else conv.bias.detach().double().view(1, -1, 1, 1)
        z = outputs[name].detach().double() - bias
        weight_grad = conv2d_weight(x, conv.weight.shape, delta.double(), stride=conv.stride,
                                    padding=conv.padding)
        systems.append(conv_system(name, conv, delta, tuple(x.shape[1:]), z, weight_grad))
    return systems


def security_metric(deficiencies: list[int]) -> float:
    """Chen & Campbell's (2022) metric: ``(1/L) sum_i (L - i + 1) rd_i`` over the convolutional layers (i from 1)."""
    n = len(deficiencies)
    return sum((n - i) * rd for i, rd in enumerate(deficiencies)) / n if n else 0.0
