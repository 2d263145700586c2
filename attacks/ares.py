"""ARES (Gong et al. 2026, "Activation REcovery via Sparse inversion"): a malicious server that changes no layer of
the model it sends, only its weights, and reads each image of a batch out of one fully connected layer's gradients.

The server crafts three parts of the network as it is:

* the layers before the chosen fully connected layer (convolutions, ReLUs, average pools, fully connected layers)
  measure the input linearly: each weight layer's outputs come in halves, the second the negatives of the first
  (random Gaussian filters), so that ``relu(u) - relu(-u) = u`` carries every measurement past each ReLU and the
  activation ``h`` entering the layer gives ``v = h_first - h_second = M x``, a random linear measurement of the
  (normalised) input; fewer measurements than pixels make it a compressed-sensing problem;
* the chosen layer becomes an imprint (Fowl et al. 2022) on ``h``: every row measures the same direction, each
  above its own threshold (at the normal quantiles of that measurement's spread), so that consecutive rows'
  gradient differences divided by their bias gradients' differences give one sample's activation alone;
* the next fully connected layer gets identical columns, so that every unit of the imprint passes on the same
  gradient for one sample (the imprint's condition), with small weights that keep the softmax away from saturation.

The attack reads the activations out of the bins (``imprint.binned_images``), turns each into its measurement
``v`` and recovers the image by the generalised Lasso ``min_p 1/2 ||A p - y||^2 + lambda ||D p||_1`` over the
pixels ``p``, with ``D`` an orthonormal 2-D DCT (natural images) or the identity (images sparse in their pixels),
solved by FISTA (Beck & Teboulle 2009) for all recovered samples at once on the update's device. Where there are
at least as many measurements as pixels the solution is the image itself, to the solver's precision.

The paper's construction is followed as far as its text was available here (the abstract: imprint-disentangled
activations, generalised Lasso, an expected recovery rate); the halved-and-negated measuring layers are this
module's way of making the layers before the imprint linear without changing them (docs/results.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from leakaudit.attacks.gradient_matching import LABEL_METHOD
from leakaudit.attacks.imprint import binned_images
from leakaudit.attacks.labels import recover_labels
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.attack import MALICIOUS_SERVER, Attack, Reconstruction, ThreatModel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import Protocol, not_one_step

#: Layers that may stand between the input and the imprint: each is linear once the weights are crafted.
MEASURING = (nn.Conv2d, nn.Linear)
PASSING = (nn.ReLU, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten, nn.Identity)
#: The next layer's columns are this share of a standard normal draw divided by the bins: logits stay small.
SPREAD_SCALE = 0.1
#: Inputs measured per forward pass when the measurement matrix is built.
CHUNK = 1024
BASES = ("dct", "pixels")
HOW = "audit it with model: {name: ares, params: {base: ...}}"


def leaves(model: nn.Module) -> list[nn.Module] | None:
    """The model's layers in the order of its forward pass, nested ``nn.Sequential`` flattened; None where the
    model is not a chain of layers (a forward of its own, residual connections)."""
    if not isinstance(model, nn.Sequential):
        return None
    found: list[nn.Module] = []
    for child in model:
        inner = leaves(child) if isinstance(child, nn.Sequential) else [child]
        if inner is None:
            return None
        found += inner
    return found


@dataclass
class Layout:
    """Where ARES acts in a chain of layers: the measuring layers before the imprint, the imprint layer itself and
    the fully connected layer after its ReLU."""

    prefix: list[nn.Module]
    imprint: nn.Linear
    spread: nn.Linear

    @property
    def paired(self) -> bool:
        """Whether the imprint's input is a halved-and-negated measurement (else it is the input itself)."""
        return any(isinstance(m, MEASURING) for m in self.prefix)

    def measure(self, x: Tensor) -> Tensor:
        """``v = M x``: the linear measurement of normalised inputs ``x`` that the imprint's input carries."""
        h = nn.Sequential(*self.prefix)(x).flatten(1)
        return h[:, :h.shape[1] // 2] - h[:, h.shape[1] // 2:] if self.paired else h


def layout(model: nn.Module, layer: int) -> Layout | str:
    """The layout with the ``layer``-th fully connected layer (from 1) as the imprint, or why there is none."""
    chain = leaves(model)
    if chain is None:
        return "ARES crafts a chain of layers (an nn.Sequential); this model has a forward of its own"
    linears = [i for i, m in enumerate(chain) if isinstance(m, nn.Linear)]
    if len(linears) < layer + 1:
        return (f"ARES imprints fully connected layer {layer} and needs one after it; the model has "
                f"{len(linears)} fully connected layers")
    at = linears[layer - 1]
    if at + 2 >= len(chain) or not isinstance(chain[at + 1], nn.ReLU) or not isinstance(chain[at + 2], nn.Linear):
        return f"ARES needs fully connected layer {layer} to be followed by a ReLU and a fully connected layer"
    if chain[at].bias is None:
        return f"ARES needs fully connected layer {layer} to have a bias (its thresholds)"
    for m in chain[:at]:
        if not isinstance(m, MEASURING + PASSING):
            return (f"ARES makes the layers before fully connected layer {layer} linear; it cannot do so through "
                    f"{type(m).__name__} (convolutions, ReLUs, average pools and fully connected layers only)")
        if isinstance(m, MEASURING) and m.weight.shape[0] % 2:
            return f"ARES pairs each measuring layer's outputs; {type(m).__name__} has an odd number of them"
    imprint, spread = chain[at], chain[at + 2]
    assert isinstance(imprint, nn.Linear) and isinstance(spread, nn.Linear)  # checked above
    return Layout(chain[:at], imprint, spread)


def crafted_layout(model: nn.Module) -> Layout | None:
    """The layout whose imprint layer a malicious server crafted (every row the same, distinct biases); None
    where the model carries none."""
    chain = leaves(model) or []
    for layer in range(1, sum(isinstance(m, nn.Linear) for m in chain)):
        found = layout(model, layer)
        if isinstance(found, Layout) and _is_imprint(found.imprint):
            return found
    return None


def _is_imprint(linear: nn.Linear) -> bool:
    w, b = linear.weight.detach(), linear.bias
    return (w.shape[0] > 1 and b is not None and bool((w - w[:1]).abs().max() <= 1e-6 * w.abs().max())
            and bool((b[:-1] > b[1:]).all()))


@torch.no_grad()
def _measuring_weights(prefix: list[nn.Module]) -> None:
    """Random Gaussian measuring layers, outputs in halves (the second the first's negatives), inputs read in the
    previous layer's halves: every measurement passes each ReLU through one half or the other."""
    first = True
    for m in prefix:
        if not isinstance(m, MEASURING):
            continue
        out, inp = m.weight.shape[0] // 2, m.weight.shape[1]
        if first:
            top = torch.randn(out, *m.weight.shape[1:]) / math.sqrt(m.weight[0].numel())
        else:
            g = torch.randn(out, inp // 2, *m.weight.shape[2:]) / math.sqrt(m.weight[0].numel() / 2)
            top = torch.cat([g, -g], dim=1)
        m.weight.copy_(torch.cat([top, -top]))
        if m.bias is not None:
            m.bias.zero_()
        first = False


def craft(model: nn.Module, input_shape: tuple[int, ...], layer: int = 1) -> nn.Module:
    """``model`` with the weights ARES's server sends (drawn from the global generator, which model building seeds):
    measuring layers, the ``layer``-th fully connected layer an imprint, the next one spreading its gradient."""
    found = layout(model, layer)
    if isinstance(found, str):
        raise ValueError(found)
    _measuring_weights(found.prefix)
    direction, spread = _imprint_direction(found, input_shape)
    with torch.no_grad():
        row = torch.cat([direction, -direction]) if found.paired else direction
        bins = found.imprint.weight.shape[0]
        found.imprint.weight.copy_(row.expand(bins, -1))
        levels = torch.arange(1, bins + 1, dtype=torch.float64) / (bins + 1)
        found.imprint.bias.copy_(-spread * torch.distributions.Normal(0.0, 1.0).icdf(levels).float())
        found.spread.weight.copy_((SPREAD_SCALE * torch.randn(found.spread.weight.shape[0], 1) / bins)
                                  .expand_as(found.spread.weight))
        if found.spread.bias is not None:
            found.spread.bias.zero_()
    return model


def _imprint_direction(found: Layout, input_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """The direction ``w`` the imprint measures in ``v`` and its spread on unit-variance inputs: ``w`` is chosen so
    that ``M^T w`` is a white Gaussian direction in pixel space (as near as ``M``'s rows reach), whose measurement of
    correlated images has about its own norm as its spread; a random ``w`` would measure smooth images, whose
    spread is several times that (docs/results.md, ARES)."""
    white = torch.randn(math.prod(input_shape))
    if not found.paired:
        return white, white.norm()
    m = measurement_matrix(found, input_shape, torch.device("cpu"))
    w = torch.linalg.lstsq(m.T, white[:, None]).solution[:, 0]
    return w, (m.T @ w).norm()


def expected_recovery_rate(bins: int, batch_size: int) -> float:
    """The share of a batch expected alone in a bin that reads out (thresholds at equal-probability quantiles:
    ``bins + 1`` intervals, the lowest activating no unit)."""
    return bins / (bins + 1) * (1 - 1 / (bins + 1)) ** (batch_size - 1)


def dct_matrix(size: int, device: torch.device) -> Tensor:
    """The orthonormal DCT-II matrix of ``size`` points."""
    k = torch.arange(size, device=device, dtype=torch.float32)
    c = torch.cos(math.pi / size * (k[None] + 0.5) * k[:, None]) * math.sqrt(2 / size)
    c[0] /= math.sqrt(2)
    return c


def dct2(images: Tensor, inverse: bool = False) -> Tensor:
    """Each channel's orthonormal 2-D DCT (or its inverse) of ``images`` (..., H, W)."""
    ch, cw = dct_matrix(images.shape[-2], images.device), dct_matrix(images.shape[-1], images.device)
    return ch.T @ images @ cw if inverse else ch @ images @ cw.T


def spectral_norm_squared(k: Tensor, steps: int = 50) -> Tensor:
    """``||K||_2^2`` by power iteration on ``K^T K`` (FISTA's step is its inverse), slightly over-estimated."""
    vec = torch.ones(k.shape[1], device=k.device, dtype=k.dtype)
    for _ in range(steps):
        vec = k.T @ (k @ vec)
        vec = vec / vec.norm()
    return (k @ vec).norm() ** 2 * 1.02


def ridge(k: Tensor, y: Tensor, step: Tensor) -> Tensor:
    """The least-norm solutions of ``K s = y_b`` (a ridge of ``1e-6 ||K||^2``: exact where the measurements
    determine the image), FISTA's start: from there it only has to add the sparsity, not undo a poor condition."""
    eps = 1e-6 / step
    if k.shape[0] >= k.shape[1]:
        gram = k.T @ k + eps * torch.eye(k.shape[1], device=k.device, dtype=k.dtype)
        return torch.linalg.solve(gram, k.T @ y.T).T
    gram = k @ k.T + eps * torch.eye(k.shape[0], device=k.device, dtype=k.dtype)
    return torch.linalg.solve(gram, y.T).T @ k


def lasso(k: Tensor, y: Tensor, lam: Tensor, iterations: int) -> Tensor:
    """FISTA (Beck & Teboulle 2009) for ``min_s 1/2 ||K s - y_b||^2 + lam_b ||s||_1``, every row ``b`` of ``y``
    (B, m) at once, from the least-norm solutions."""
    step = 1 / spectral_norm_squared(k)
    s = z = ridge(k, y, step)
    t = 1.0
    for _ in range(iterations):
        moved = z - step * ((z @ k.T - y) @ k)
        nxt = moved.sign() * (moved.abs() - step * lam).clamp_min(0)
        t_next = (1 + math.sqrt(1 + 4 * t * t)) / 2
        z = nxt + (t - 1) / t_next * (nxt - s)
        s, t = nxt, t_next
    return s


@torch.no_grad()
def measurement_matrix(found: Layout, input_shape: tuple[int, ...], device: torch.device) -> Tensor:
    """``M`` (m, n) with ``v = M x`` for normalised inputs ``x``, built by measuring the basis images (the crafted
    map is linear, its biases zero)."""
    n = math.prod(input_shape)
    columns = []
    for start in range(0, n, CHUNK):
        rows = torch.arange(start, min(start + CHUNK, n), device=device)
        basis = torch.zeros(len(rows), n, device=device)
        basis[torch.arange(len(rows), device=device), rows] = 1.0
        columns.append(found.measure(basis.view(-1, *input_shape)))
    return torch.cat(columns).T


class Ares(Attack):
    """Each image of the batch from its activation at a crafted fully connected layer: the imprint's bins give the
    activation alone, the generalised Lasso the image from it (Gong et al. 2026). Images no bin isolates come back
    as the data's mean image."""
    attacker = MALICIOUS_SERVER

    name = "ares"
    paper = "Gong et al. 2026"
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {}}
    brings = "a malicious server's crafted weights in the model as it is (model: ares), where the threat model " \
             "allows one"
    params = {
        "lasso_lambda": Param(1e-4, float, min=0.0, help="the Lasso's weight on sparsity, as a share of the least "
                                                         "weight that leaves nothing (per image): raise it under noise"),
        "basis": Param("dct", str, choices=BASES, help="where images are sparse: dct (natural images, a 2-D DCT "
                                                       "per channel) or pixels (digits, sketches)"),
        "iterations": Param(1000, int, min=0, budget=True, help="FISTA's iterations from the least-norm solution "
                                                                "(0: that solution alone, no sparsity)"),
        "label_method": LABEL_METHOD,
    }
    lasso_lambda: float
    basis: str
    iterations: int
    label_method: str

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if crafted_layout(model) is None:
            return ("ares reads a fully connected layer whose weights a malicious server crafted (Gong et al. "
                    f"2026); {HOW}")
        return not_one_step(protocol, batch_size, self.name)

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        found = crafted_layout(threat.model)
        assert found is not None  # unsupported() refuses a model without one
        name = next(n for n, m in threat.model.named_modules() if m is found.imprint)
        grads = dict(zip(observed.names, observed.tensors))
        activations = binned_images(grads[f"{name}.weight"].to(threat.device),
                                    grads[f"{name}.bias"].to(threat.device), threat.batch_size)
        images = threat.mean.to(threat.device).expand(threat.batch_size, *threat.input_shape).clone()
        if len(activations):
            images[:len(activations)] = self.recover(activations, found, threat)
        labels = recover_labels(observed, threat, self.label_method, generator)
        return Reconstruction(images.clamp(0, 1), labels, [], 0.0, {"bins_filled": len(activations)})

    def recover(self, activations: Tensor, found: Layout, threat: ThreatModel) -> Tensor:
        """Pixel-space images from imprint-layer activations (k, width): the generalised Lasso on their
        measurements."""
        half = activations.shape[1] // 2
        v = activations[:, :half] - activations[:, half:] if found.paired else activations
        shape = threat.input_shape
        m = measurement_matrix(found, shape, threat.device)
        mean, std = (t.to(threat.device).expand(shape).flatten() for t in (threat.mean, threat.std))
        a, offset = m / std, m @ (mean / std)  # v = A p - offset for images p in pixel space
        k = dct2(a.view(-1, *shape)).flatten(1) if self.basis == "dct" else a
        y = v + offset
        lam = self.lasso_lambda * (y @ k).abs().amax(dim=1, keepdim=True)
        s = lasso(k, y, lam, self.iterations).view(-1, *shape)
        return dct2(s, inverse=True) if self.basis == "dct" else s


@hookimpl
def register_attacks():
    return [Ares]
