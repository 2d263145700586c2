"""Bayesian layers (Bayes by backprop, Blundell et al. 2015) as a defense (Chen et al. 2024).

Each converted ``nn.Linear`` or ``nn.Conv2d`` keeps a mean ``mu`` and a scale parameter
``rho`` per weight and bias; every forward pass samples ``W = mu + softplus(rho) * eps``
with ``eps ~ N(0, 1)`` (one draw per pass, or one per example), and training adds
``kl_weight`` times ``KL(N(mu, softplus(rho)^2) || N(0, prior_sigma^2))``. The client
shares the gradients of ``mu`` and ``rho``, or only of ``mu`` (``share_scales: false``: the
scales stay at ``init_scale``, known to the server).

With one draw per pass, ``dL/drho = dL/dW * eps * sigmoid(rho)`` and ``dL/dmu = dL/dW``,
so the two shared gradients give ``eps`` exactly wherever ``dL/dW`` is non-zero:
``attacks.bayesian`` collapses the network to a deterministic one that way.
"""
from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import Defense
from leakaudit.plugins.protocol import LossFn
from leakaudit.plugins.stochastic import StochasticModule, stochastic_modules, with_kl

NOISE = ("per_pass", "per_example")


def inverse_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


class BayesianLayer(StochasticModule):
    """A layer with Gaussian weights: means, scale parameters, a KL term and per-forward sampling.

    The scale parameters are registered before the means, so the last weight and bias a
    reader finds in the shared update (label recovery) are the means, which play the
    deterministic layer's part (Chen et al. 2024, appendix A).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, init_scale: float, prior_sigma: float,
                 per_example: bool) -> None:
        super().__init__()
        rho = inverse_softplus(init_scale)
        self.weight_rho = nn.Parameter(torch.full_like(weight, rho))
        self.bias_rho = None if bias is None else nn.Parameter(torch.full_like(bias, rho))
        self.weight_mu = nn.Parameter(weight.detach().clone())
        self.bias_mu = None if bias is None else nn.Parameter(bias.detach().clone())
        self.prior_sigma = prior_sigma
        self.per_example = per_example
        self.given_noise: tuple[Tensor, ...] | None = None  # (eps_weight[, eps_bias]) to use, not draw

    @property
    def weight(self) -> Tensor:
        """The mean weight (what readers of a plain layer's weight get)."""
        return self.weight_mu

    @property
    def bias(self) -> Tensor | None:
        return self.bias_mu

    def pairs(self) -> list[tuple[Tensor, Tensor]]:
        """(mean, scale parameter) of the weight and of the bias."""
        out: list[tuple[Tensor, Tensor]] = [(self.weight_mu, self.weight_rho)]
        return out if self.bias_mu is None else out + [(self.bias_mu, cast(Tensor, self.bias_rho))]

    def noise_shapes(self, batch: int) -> list[tuple[int, ...]]:
        """Shapes of the draws one forward pass of ``batch`` examples makes (weight, then bias)."""
        lead = (batch,) if self.per_example else ()
        return [(*lead, *mu.shape) for mu, _ in self.pairs()]

    def kl_divergence(self, pairs: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
        """KL of the posterior N(mu, softplus(rho)^2) from the prior N(0, prior_sigma^2), summed.

        Of the layer's own parameters, or of ``pairs`` (those a forward pass under
        ``functional_call`` used).
        """
        total: Tensor | float = 0.0
        for mu, rho in self.pairs() if pairs is None else pairs:
            s = F.softplus(rho)
            total = total + (math.log(self.prior_sigma) - s.log()
                             + (s ** 2 + mu ** 2) / (2 * self.prior_sigma ** 2) - 0.5).sum()
        return cast(Tensor, total)  # a layer has a weight at least

    def forward(self, x: Tensor) -> Tensor:
        noise: Sequence[Tensor] | None = self.given_noise
        if noise is None:
            noise = [self.standard_normal(shape, x) for shape in self.noise_shapes(len(x))]
        pairs = self.pairs()
        sampled = [mu + F.softplus(rho) * eps for (mu, rho), eps in zip(pairs, noise)]
        self._kl_term: Callable[[], Tensor] | None = lambda: self.kl_divergence(pairs)
        weight, bias = sampled[0], (sampled[1] if len(sampled) > 1 else None)
        return self.apply_weights(x, weight, bias)

    def apply_weights(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        raise NotImplementedError

    def deterministic(self, weight: Tensor, bias: Tensor | None) -> nn.Module:
        """The plain layer with these weights."""
        raise NotImplementedError


class BayesianLinear(BayesianLayer):
    def apply_weights(self, x, weight, bias):
        if weight.dim() == 2:
            return F.linear(x, weight, bias)
        out = torch.einsum("bi,boi->bo", x, weight)
        return out if bias is None else out + bias

    def deterministic(self, weight, bias):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None).to(weight.device)
        return _with_weights(layer, weight, bias)


class BayesianConv2d(BayesianLayer):
    def __init__(self, conv: nn.Conv2d, *args: Any) -> None:
        super().__init__(conv.weight, conv.bias, *args)
        self.options = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups)

    def apply_weights(self, x, weight, bias):
        if weight.dim() == 4:
            return F.conv2d(x, weight, bias, **self.options)
        return torch.cat([F.conv2d(x[i:i + 1], weight[i], None if bias is None else bias[i], **self.options)
                          for i in range(len(x))])

    def deterministic(self, weight, bias):
        out_c, in_c, kh, kw = weight.shape
        layer = nn.Conv2d(in_c * self.options["groups"], out_c, (kh, kw), bias=bias is not None, **self.options)
        return _with_weights(layer.to(weight.device), weight, bias)


def _with_weights(layer: nn.Module, weight: Tensor, bias: Tensor | None) -> nn.Module:
    with torch.no_grad():
        cast(Tensor, layer.weight).copy_(weight)
        if bias is not None:
            cast(Tensor, layer.bias).copy_(bias)
    return layer


def bayesian_layers(model: nn.Module) -> dict[str, BayesianLayer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, BayesianLayer)}


def convertible(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m) in (nn.Linear, nn.Conv2d)]


def to_bayesian(model: nn.Module, names: Sequence[str], init_scale: float, prior_sigma: float,
                per_example: bool) -> nn.Module:
    """Replace the named Linear and Conv2d layers by Bayesian ones whose means are their current weights."""
    for name in names:
        layer = model.get_submodule(name)
        if isinstance(layer, nn.Conv2d):
            new: BayesianLayer = BayesianConv2d(layer, init_scale, prior_sigma, per_example)
        else:
            linear = cast(nn.Linear, layer)  # convertible() lists Linear and Conv2d layers only
            new = BayesianLinear(linear.weight, linear.bias, init_scale, prior_sigma, per_example)
        model.set_submodule(name, new)
    return model


@contextmanager
def given_noise(model: nn.Module, noise: dict[str, list[Tensor]]) -> Iterator[None]:
    """Inside the block each named Bayesian layer uses ``noise`` (weight, then bias) instead of drawing. The
    block's last KL term is dropped at its end: it holds the block's tensors (under torch.func, wrapped ones that
    must not outlive the transform, nor leave a compiled step)."""
    layers = bayesian_layers(model)
    for name, eps in noise.items():
        layers[name].given_noise = tuple(eps)
    try:
        yield
    finally:
        for name in noise:
            layers[name].given_noise = None
            layers[name]._kl_term = None


def collapse(model: nn.Module, noise: dict[str, list[Tensor]]) -> nn.Module:
    """A deterministic copy of ``model``: each Bayesian layer fixed at ``mu + softplus(rho) * eps``."""
    plain = copy.deepcopy(model)
    for name, layer in bayesian_layers(plain).items():
        with torch.no_grad():
            w = [mu + F.softplus(rho) * eps for (mu, rho), eps in zip(layer.pairs(), noise[name])]
        plain.set_submodule(name, layer.deterministic(w[0], w[1] if len(w) > 1 else None))
    return plain


class Bayesian(Defense):
    """Turns chosen layers into Bayesian layers (weights sampled every forward pass), trained with KL."""

    name = "bayesian"
    modalities = ("image",)  # its attacks are the image ones; not yet built or checked for text models
    paper = "Chen et al. 2024"
    params = {
        "layers": Param("all", (str, list), help="layers to convert: 'all', 'last', or a list of module names "
                                                 "of Linear and Conv2d layers"),
        "prior_sigma": Param(1.0, float, min=0.0, exclusive_min=True, help="std of the N(0, s^2) weight prior"),
        "init_scale": Param(0.05, float, min=0.0, exclusive_min=True, help="initial std of every weight"),
        "kl_weight": Param(1e-4, float, min=0.0, protects="higher", help="weight of the KL term in the client's loss"),
        "noise": Param("per_pass", str, choices=NOISE, help="one weight draw per forward pass, or per example"),
        "share_scales": Param(True, bool, help="share the scales' gradients beside the means' (false: the "
                                               "scales stay at init_scale, known to the server)"),
    }
    layers: str | list[Any]
    prior_sigma: float
    init_scale: float
    kl_weight: float
    noise: str
    share_scales: bool

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        if isinstance(self.layers, list) and not all(isinstance(n, str) for n in self.layers):
            raise ValueError(f"bayesian: layers must be 'all', 'last' or a list of module names, got {self.layers!r}")

    def _names(self, model: nn.Module) -> list[str]:
        found = convertible(model)
        if not found:
            raise ValueError("bayesian: the model has no Linear or Conv2d layer to convert")
        if self.layers == "all":
            return found
        if self.layers == "last":
            return found[-1:]
        wanted = [self.layers] if isinstance(self.layers, str) else self.layers
        unknown = [n for n in wanted if n not in found]
        if unknown:
            raise ValueError(f"bayesian: layers {', '.join(map(repr, unknown))} are not Linear or Conv2d layers of "
                             f"the model; choices: all, last, {', '.join(found)}")
        return wanted

    def wrap_model(self, model: nn.Module) -> nn.Module:
        names = self._names(model)
        to_bayesian(model, names, self.init_scale, self.prior_sigma, self.noise == "per_example")
        if not self.share_scales:
            for layer in bayesian_layers(model).values():
                for _, rho in layer.pairs():
                    rho.requires_grad_(False)
        self.model_changes = [f"{n}: Bayesian {type(model.get_submodule(n)).__name__} (mean and scale, "
                              f"initial std {self.init_scale}, prior N(0, {self.prior_sigma}^2), {self.noise} noise, "
                              f"shares {'mean and scale' if self.share_scales else 'mean only'})" for n in names]
        return model

    def client_loss(self, model: nn.Module, loss_fn: LossFn) -> LossFn:
        return with_kl(model, loss_fn, self.kl_weight)

    def parameter_term(self, model: nn.Module) -> Tensor | None:
        """The weighted KL that ``client_loss`` adds: it depends on the layers' means and scales alone (None where
        the model holds other noisy modules, whose terms ``client_loss`` adds too)."""
        layers = bayesian_layers(model)
        if self.kl_weight == 0 or len(layers) != len(stochastic_modules(model)):
            return None
        return self.kl_weight * cast(Tensor, sum(layer.kl_divergence() for layer in layers.values()))


@hookimpl
def register_defenses():
    return [Bayesian]
