"""Soteria (Sun et al. 2021): prune the weight gradient of one fully connected layer by feature sensitivity.

For each feature ``r_f`` of the representation entering the defended layer, the score is
``sum_b ||d r_{b,f} / d x_b|| / |r_{b,f}|`` (how much the input must move per unit of the
feature, as the reference code computes it: one backward pass per feature, summed over
the batch); the ``fraction`` of lowest-scoring features have their columns of the layer's
weight gradient zeroed. Every other tensor is sent unchanged, which is its weakness:
the informed attacker drops the defended layer and matches the rest (Balunovic et al. 2022, A.5).
"""
from __future__ import annotations

from typing import Any, Sequence, cast

import torch
from torch import Tensor, nn

from leakaudit.defenses.layers import fully_connected_layer
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import Defense, SharedUpdate
from leakaudit.plugins.protocol import ClientStep, FedSGD, Protocol, parameter_names

#: Features whose input-gradient is computed in one batched backward pass.
CHUNK = 256


def feature_scores(model: nn.Module, layer: nn.Module, inputs: Tensor) -> Tensor:
    """Soteria's score of every input feature of ``layer`` for this batch, shape (features,).

    Features that are zero for every example score NaN: their weight-gradient columns
    are zero already, and ``pruning_mask`` spends the pruning rate on the others.
    """
    captured: list[Tensor] = []
    handle = layer.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    x = inputs.detach().requires_grad_(True)
    try:
        with torch.enable_grad():
            model(x)
    finally:
        handle.remove()
    r = captured[0].flatten(1)
    batch, n = r.shape
    norms = torch.empty(n, batch, device=r.device, dtype=r.dtype)
    eye = torch.eye(n, device=r.device, dtype=r.dtype)
    for start in range(0, n, CHUNK):
        rows = eye[start:start + CHUNK]
        seeds = rows[:, None, :].expand(len(rows), batch, n)  # one backward pass per feature, all examples at once
        (dx,) = torch.autograd.grad(r, x, seeds, retain_graph=True, is_grads_batched=True)
        norms[start:start + len(rows)] = dx.flatten(2).norm(dim=2)
    values = r.detach().abs().T
    score = torch.where(values > 0, norms / values.clamp_min(torch.finfo(r.dtype).tiny), torch.zeros_like(norms))
    score = score.sum(dim=1)
    return torch.where((values > 0).any(dim=1), score, torch.full_like(score, float("nan")))


def pruning_mask(scores: Tensor, fraction: float) -> Tensor:
    """0 for the ``floor(fraction * n)`` lowest-scoring of the ``n`` live (non-NaN) features, 1 elsewhere."""
    mask = torch.ones_like(scores)
    live = ~scores.isnan()
    k = int(fraction * int(live.sum()))
    if k:
        order = torch.argsort(torch.where(live, scores, torch.full_like(scores, float("inf"))))
        mask[order[:k]] = 0
    return mask


class Soteria(Defense):
    """Zeroes the weight-gradient columns of a fully connected layer's least sensitive input features."""

    name = "soteria"
    modalities = ("image",)  # its feature scores differentiate the pixels
    paper = "Sun et al. 2021"
    deterministic = True
    params = {
        "layer": Param("largest", str, help="defended fully connected layer: a module name, or 'largest'"),
        "fraction": Param(0.8, float, min=0.0, max=1.0, protects="higher", help="pruning rate: share of the layer's input "
                                                              "features whose gradient columns are zeroed"),
    }
    layer: str
    fraction: float

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.layer_name: str | None = None if self.layer == "largest" else self.layer

    def unsupported(self, protocol: Protocol) -> str | None:
        if not isinstance(protocol, FedSGD):
            return "soteria prunes one gradient computed on the batch's representation; use protocol: fedsgd"
        return None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Leaves the model as it is; resolves (and checks) the defended layer."""
        self.layer_name = fully_connected_layer(model, self.layer, "soteria", "layer", "largest")
        return model

    def share(self, step: ClientStep) -> SharedUpdate:
        if self.layer_name is None:
            self.wrap_model(step.model)
        layer = step.model.get_submodule(cast(str, self.layer_name))  # wrap_model named it
        mask = pruning_mask(feature_scores(step.model, layer, step.inputs), self.fraction)
        names = parameter_names(step.model)
        update = step.clean_update()
        defended = f"{self.layer_name}.weight"
        sent = [g * mask if n == defended else g for n, g in zip(names, update)]
        return SharedUpdate(sent, names, len(step.inputs), {"protocol": step.protocol.name})

    def defended_tensors(self, names: Sequence[str]) -> set[str]:
        return {f"{self.layer_name}.weight"}

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """Zero-noise Gaussian on every tensor but the defended layer's weight (Balunovic et al. 2022, Eq. 6)."""
        dropped = self.defended_tensors(observed.names)
        return -0.5 * cast(Tensor, sum(((o - c) ** 2).sum() for n, o, c in
                                       zip(observed.names, observed.tensors, candidate) if n not in dropped))


@hookimpl
def register_defenses():
    return [Soteria]
