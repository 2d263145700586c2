"""Analytic inversion of a fully connected input layer (Geiping et al. 2020, Prop. 3.1 and its supplement)."""
from __future__ import annotations

from typing import Any, Callable, ClassVar, cast

import torch
from torch import Tensor, nn

from leakaudit.attacks.labels import recover_labels
from leakaudit.plugins import hookimpl
from leakaudit.plugins.attack import Attack, Reconstruction, ThreatModel, HONEST_SERVER
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import Protocol

#: Elementwise activations whose derivative is a function of their output.
DERIVATIVE_FROM_OUTPUT = {
    nn.ReLU: lambda a: (a > 0).to(a.dtype),
    nn.LeakyReLU: None,  # slope depends on the module; handled below
    nn.Sigmoid: lambda a: a * (1 - a),
    nn.Tanh: lambda a: 1 - a ** 2,
    nn.Identity: lambda a: torch.ones_like(a),
}


def solve_input(weight_grad: Tensor, out_grad: Tensor) -> Tensor:
    """``x`` from ``dL/dW = delta x^T`` and ``delta`` by least squares: ``W_grad^T delta / |delta|^2``."""
    return weight_grad.T @ out_grad / (out_grad @ out_grad).clamp_min(1e-30)


def _input_layers(model: nn.Module) -> tuple[nn.Linear, nn.Module | None, nn.Linear | None]:
    """The first Linear layer when it sees the raw (flattened) image, plus the activation and Linear after it."""
    layers = list(model) if isinstance(model, nn.Sequential) else [model]
    while layers and isinstance(layers[0], nn.Flatten):
        layers = layers[1:]
    if not layers or not isinstance(layers[0], nn.Linear):
        raise ValueError("analytic: the model must start with a fully connected layer (after an optional Flatten), "
                         "as nn.Sequential; for convolutional inputs use a layer-wise attack")
    act = layers[1] if len(layers) > 2 else None
    nxt = layers[2] if len(layers) > 2 and isinstance(layers[2], nn.Linear) else None
    return layers[0], act, nxt


class AnalyticInversion(Attack):
    """Closed-form input of a fully connected first layer from its weight and bias gradients (exact, one image)."""
    attacker = HONEST_SERVER

    name = "analytic"
    paper = "Geiping et al. 2020"
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {}}

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        """Why this attack cannot apply to the scenario, or None."""
        if batch_size != 1 or not protocol.sends_gradient:
            return "analytic: exact for one image and FedSGD only (data.batch_size 1, protocol fedsgd)"
        try:
            first, act, nxt = _input_layers(model)
        except ValueError as exc:
            return str(exc)
        if first.bias is None and (nxt is None or nxt.bias is None or type(act) not in DERIVATIVE_FROM_OUTPUT):
            return ("analytic: the first layer has no bias, so the next layer must be a biased Linear after "
                    f"one of {', '.join(t.__name__ for t in DERIVATIVE_FROM_OUTPUT)}")
        return None

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        why = self.unsupported(threat.model, threat.batch_size, threat.protocol)
        if why:
            raise ValueError(why)
        grads = dict(zip(observed.names, observed.tensors))
        names = {id(p): n for n, p in threat.model.named_parameters()}
        first, act, nxt = _input_layers(threat.model)
        gw = grads[names[id(first.weight)]]
        if first.bias is not None:
            delta = grads[names[id(first.bias)]]
        else:
            delta = self._delta_from_next_layer(grads, names, act, nxt)
        x = solve_input(gw.double(), delta.double()).float()
        images = threat.to_pixels(x.view(1, *threat.input_shape))
        labels = recover_labels(observed, threat, "signs", generator)
        return Reconstruction(images, labels, [], 0.0)

    @staticmethod
    def _delta_from_next_layer(grads: dict, names: dict, act: nn.Module, nxt: nn.Linear) -> Tensor:
        """``dL/dy`` of a bias-free layer from the next layer: its input ``a`` analytically, then the chain rule."""
        g_next_w, g_next_b = grads[names[id(nxt.weight)]], grads[names[id(nxt.bias)]]
        a = solve_input(g_next_w.double(), g_next_b.double())
        if isinstance(act, nn.LeakyReLU):
            slope = torch.where(a > 0, torch.ones_like(a), torch.full_like(a, act.negative_slope))
        else:
            slope = cast(Callable[[Tensor], Tensor], DERIVATIVE_FROM_OUTPUT[type(act)])(a)
        return (slope * (nxt.weight.detach().double().T @ g_next_b.double())).to(g_next_w.dtype)


@hookimpl
def register_attacks():
    return [AnalyticInversion]
