"""Layer-wise inversion by linear systems: ``rgap`` (Zhu and Blaschko 2021) and ``hybrid`` (Chen & Campbell 2022).

Walking from the output back to the input, every layer's input is solved from its gradients:
a biased fully connected layer gives it in closed form (``x = dL/dW^T delta / |delta|^2``);
an invertible activation is undone (tanh, sigmoid, leaky ReLU); a convolution's input solves
``A x = [z; dL/dW]`` (``attacks.linear_system``) by least squares with the minimum norm.
``hybrid`` corrects each convolution's solution by gradient matching on the truncated network
from that layer on (cosine distance per tensor), with the linear system as a soft constraint and
total variation on the layer's input (Chen & Campbell 2022, Algorithm 1 and its appendix B), before
going on; its steps and weights differ for the first, the second and the other convolutions, with
Appendix D's values as defaults.
One image, FedSGD only; the model is a chain of Conv2d, invertible activations, Flatten and
Linear layers, with a biased last layer.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.func import functional_call

from leakaudit.attacks.analytic import solve_input
from leakaudit.attacks.labels import recover_labels
from leakaudit.attacks.linear_system import ACTIVATIONS, conv_system, layers_of, min_norm_solution
from leakaudit.attacks.priors import total_variation
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.attack import Attack, Reconstruction, ThreatModel, HONEST_SERVER
from leakaudit.plugins.defense import SharedUpdate, cosine_distance, per_tensor_cosine_distance
from leakaudit.plugins.protocol import Protocol

#: Clamp before inverting tanh and sigmoid (their inverses diverge at the ends of the range).
EPS = 1e-7


def _inverse(act: nn.Module, a: Tensor) -> Tensor:
    if isinstance(act, nn.Tanh):
        return torch.atanh(a.clamp(-1 + EPS, 1 - EPS))
    if isinstance(act, nn.Sigmoid):
        return torch.logit(a.clamp(EPS, 1 - EPS))
    if isinstance(act, nn.LeakyReLU):
        return torch.where(a > 0, a, a / act.negative_slope)
    return a  # Identity


def _slope(act: nn.Module, z: Tensor) -> Tensor:
    if isinstance(act, nn.Tanh):
        return 1 - torch.tanh(z) ** 2
    if isinstance(act, nn.Sigmoid):
        s = torch.sigmoid(z)
        return s * (1 - s)
    if isinstance(act, nn.LeakyReLU):
        return torch.where(z > 0, torch.ones_like(z), torch.full_like(z, act.negative_slope))
    return torch.ones_like(z)


INVERTIBLE = (nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Identity)


def why_not_invertible(model: nn.Module) -> str | None:
    """Why the layer-wise walk cannot run on ``model``; None when it can."""
    try:
        chain = layers_of(model)
    except ValueError as exc:
        return str(exc)
    for name, m in chain:
        if isinstance(m, ACTIVATIONS) and not isinstance(m, INVERTIBLE):
            return f"layer {name}: {type(m).__name__} is not invertible (tanh, sigmoid, leaky ReLU and identity are)"
    weights = [(n, m) for n, m in chain if isinstance(m, (nn.Conv2d, nn.Linear))]
    if not weights or not isinstance(weights[-1][1], nn.Linear) or weights[-1][1].bias is None:
        return "the last weight layer must be a fully connected layer with a bias"
    for n, m in weights:
        if isinstance(m, nn.Linear) and m.bias is None:
            return f"layer {n}: a fully connected layer needs a bias to give its input"
    return None


class LayerwiseInversion(Attack):
    """R-GAP: each layer's input from its linear system, last layer first (minimum-norm least squares)."""
    attacker = HONEST_SERVER

    name = "rgap"
    paper = "Zhu & Blaschko 2021"
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {}}
    solves_linear_systems = True
    params = {
        "dense_limit": Param(60_000_000, int, min=1, help="largest system solved densely (entries); larger "
                                                          "ones by conjugate gradients, matrix-free"),
        "cg_iterations": Param(3000, int, min=1, help="conjugate-gradient steps for systems beyond dense_limit"),
    }
    dense_limit: int
    cg_iterations: int

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if batch_size != 1 or not protocol.sends_gradient:
            return "rgap: one image under FedSGD only (data.batch_size 1, protocol fedsgd)"
        why = why_not_invertible(model)
        return f"rgap: {why}" if why else None

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        model = threat.model
        grads = dict(zip(observed.names, [t.to(threat.device).double() for t in observed.tensors]))
        names = {id(p): n for n, p in model.named_parameters()}
        chain = layers_of(model)
        shapes = _input_shapes(model, chain, threat)
        labels = recover_labels(observed, threat, "signs", generator)
        value: Any = None  # set by the last layer, a Linear one (``unsupported`` checks it), then the chain
        grad: Any = None
        trace: list[float] = []
        for index in range(len(chain) - 1, -1, -1):
            name, layer = chain[index]
            if isinstance(layer, nn.Linear):
                delta = grads[names[id(layer.bias)]]
                value = solve_input(grads[names[id(layer.weight)]], delta)
                grad = layer.weight.detach().double().T @ delta
            elif isinstance(layer, nn.Flatten):
                value, grad = value.view(shapes[index]), grad.view(shapes[index])
            elif isinstance(layer, nn.Conv2d):
                z = value - (0 if layer.bias is None else layer.bias.detach().double().view(-1, 1, 1))
                system = conv_system(name, layer, grad.unsqueeze(0), shapes[index], z,
                                     grads[names[id(layer.weight)]])
                value = min_norm_solution(system, self.dense_limit, self.cg_iterations).view(shapes[index])
                value = self._correct(value, system, index, chain, grads, names, threat, labels, trace)
                grad = system.input_gradient()
            else:
                z = _inverse(layer, value)
                value, grad = z, grad * _slope(layer, z)
        images = threat.to_pixels(value.unsqueeze(0).to(threat.mean.dtype))
        return Reconstruction(images, labels, trace, 0.0)

    def _correct(self, value: Tensor, system: Any, index: int, chain, grads, names, threat, labels,
                 trace: list[float]) -> Tensor:
        """R-GAP keeps the least-squares solution as it is."""
        return value


#: Chen & Campbell 2022, Appendix D: per convolution counted from the input, (first, second, every other).
#: Their total variation weights 1 / 1 / 0.1 are scaled by 0.05 for this module's total variation (a mean over
#: pixels): unscaled, they over-smooth (CNN4 V2, one image: MSE 0.044 against rgap's 0.036; scaled, 0.017).
APPENDIX_D: dict[str, list[Any]] = {"iterations": [10000, 8000, 1000], "cosine_weight": [1.0, 1.0, 10.0], "tv": [0.05, 0.05, 0.005],
              "system_weight": [0.05, 0.1, 1.0]}
COSINES = {"per_tensor": per_tensor_cosine_distance, "joint": cosine_distance}


def _per_layer(name: str, help: str, minimum: float) -> Param:
    return Param(APPENDIX_D[name], type(APPENDIX_D[name][0]), min=minimum, items=3,
                 help=f"{help}: one value for every convolution, or three (the first convolution from the input, "
                      "the second, the others)")


class HybridInversion(LayerwiseInversion):
    """Chen & Campbell's (2022) hybrid: each convolution's least-squares input corrected by gradient matching."""

    name = "hybrid"
    paper = "Chen & Campbell 2022"
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {}
    auto_skip = ("at its defaults it is rgap, which runs; its correction is set per model "
                 "(configs/linear_systems.yaml)")
    params = {
        **LayerwiseInversion.params,
        "iterations": _per_layer("iterations", "Adam steps of the correction", 1),
        "lr": Param(0.01, float, min=0.0, exclusive_min=True, help="Adam step size"),
        "cosine_weight": _per_layer("cosine_weight", "weight of the gradient-matching term", 0.0),
        "system_weight": _per_layer("system_weight", "weight of ||A x - b||^2 / ||b||^2 (soft constraint)", 0.0),
        "tv": _per_layer("tv", "total variation weight on the layer's input", 0.0),
        "cosine": Param("per_tensor", str, choices=tuple(COSINES),
                        help="per_tensor: each tensor's cosine distance, summed (Chen & Campbell 2022); joint: "
                             "all tensors as one vector"),
    }
    iterations: int | list[int]
    lr: float
    cosine_weight: float | list[float]
    system_weight: float | list[float]
    tv: float | list[float]
    cosine: str

    def setting(self, name: str, conv: int) -> int | float:
        """The value of a per-layer setting at the ``conv``-th convolution from the input (0: the first)."""
        value = getattr(self, name)
        return value[min(conv, 2)] if isinstance(value, list) else value

    def _correct(self, value, system, index, chain, grads, names, threat, labels, trace) -> Tensor:
        conv = sum(isinstance(m, nn.Conv2d) for _, m in chain[:index])
        weights = {n: self.setting(n, conv) for n in ("cosine_weight", "system_weight", "tv")}
        later = nn.Sequential(*[m for _, m in chain[index:]])
        params = {n: p.detach().double().requires_grad_(True) for n, p in later.named_parameters()}
        order = list(params)
        target = [grads[names[id(p)]] for p in later.parameters()]
        x = value.clone().unsqueeze(0).requires_grad_(True)
        optimiser = torch.optim.Adam([x], lr=self.lr)
        rhs_norm = (system.rhs ** 2).sum().clamp_min(1e-30)
        losses = torch.empty(int(self.setting("iterations", conv)), dtype=x.dtype, device=x.device)
        for it in range(len(losses)):
            loss = self._objective(later, params, order, x, labels, target, threat.loss_fn, system, rhs_norm,
                                   **weights)
            (x.grad,) = torch.autograd.grad(loss, x)
            optimiser.step()
            losses[it] = loss.detach()
        trace.extend(losses.tolist())
        return x.detach().squeeze(0)

    def _objective(self, later, params, order, x, labels, target, loss_fn, system, rhs_norm, cosine_weight,
                   system_weight, tv) -> Tensor:
        with torch.enable_grad():
            loss = loss_fn(functional_call(later, params, (x,)), labels)
            candidate = torch.autograd.grad(loss, [params[n] for n in order], create_graph=True)
            total = cosine_weight * COSINES[self.cosine](target, candidate)
            total = total + system_weight * ((system.apply(x.reshape(-1)) - system.rhs) ** 2).sum() / rhs_norm
            if tv:
                total = total + tv * total_variation(x)
        return total


def _input_shapes(model: nn.Module, chain, threat: ThreatModel) -> list[tuple[int, ...]]:
    """Each layer's input shape (without the batch dimension), from one forward pass of zeros."""
    shapes: list[tuple[int, ...]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: shapes.append(tuple(args[0].shape[1:])))
             for _, m in chain]
    try:
        with torch.no_grad():
            model(torch.zeros(1, *threat.input_shape, device=threat.device))
    finally:
        for h in hooks:
            h.remove()
    return shapes


@hookimpl
def register_attacks():
    return [LayerwiseInversion, HybridInversion]
