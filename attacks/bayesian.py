"""Attacks on Bayesian-layer networks (defense ``bayesian``).

``bayesian_kl`` (Chen et al. 2024): the weights' noise is unknown, so it is optimised with the
image, regularised towards N(0, 1) by the KL term of Chen et al.'s (2024) appendix B, under cosine
matching with total variation (Inverting Gradients' objective).

``bayesian_exact``: with one draw per forward pass, ``W = mu + softplus(rho) * eps`` gives
``dL/dmu = dL/dW`` and ``dL/drho = dL/dW * eps * sigmoid(rho)``. After the KL term's
gradient (which the server computes from the weights alone) is taken off, the two shared
gradients give ``eps = (dL/drho) / (dL/dmu * sigmoid(rho))`` wherever ``dL/dW`` is non-zero
(``eps = 0``, the prior's mean, elsewhere). The network is then deterministic and its
update is ``dL/dW``: Inverting Gradients attacks that. It does not apply when each example
draws its own noise (the batch's gradient mixes their draws), when only the means are
shared, or under FedAvg (each local step draws afresh).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, cast

import torch
from torch import Tensor, nn
from typing_extensions import Self

from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.attacks.vectorised import Plain
from leakaudit.defenses.bayesian import Bayesian, bayesian_layers, collapse, given_noise
from leakaudit.defenses.noise import NoDefense
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.attack import Problem, Reconstruction, ThreatModel
from leakaudit.plugins.defense import Defense, SharedUpdate
from leakaudit.plugins.protocol import Protocol, parameter_names


def _needs_bayesian_fedsgd(model: nn.Module, protocol: Protocol, attack: str, instead: str = "") -> str | None:
    """Why an attack on Bayesian layers cannot run: no such layers, or FedAvg's fresh draw per local step."""
    if not bayesian_layers(model):
        return f"{attack}: the model has no Bayesian layers (defense bayesian)"
    if not protocol.sends_gradient:
        return f"{attack}: each FedAvg local step draws fresh noise; use protocol fedsgd{instead}"
    return None


def kl_weight_of(defense: Defense) -> float:
    """The KL weight the client trains with (0 when the audited defense is not ``bayesian``)."""
    members = getattr(defense, "members", [defense])
    return sum(m.kl_weight for m in members if isinstance(m, Bayesian))


def data_gradients(observed: SharedUpdate, model: nn.Module, kl_weight: float) -> dict[str, Tensor]:
    """The shared tensors by name with the KL term's gradient taken off (it depends on the weights only)."""
    params = dict(model.named_parameters())
    shared = [params[n] for n in observed.names]
    grads = dict(zip(observed.names, observed.tensors))
    if kl_weight == 0:
        return grads
    with torch.enable_grad():
        kl = kl_weight * cast(Tensor, sum(layer.kl_divergence() for layer in bayesian_layers(model).values()))
        kl_grads = torch.autograd.grad(kl, shared, allow_unused=True)
    return {n: g if k is None else g - k.detach() for (n, g), k in zip(grads.items(), kl_grads)}


def recover_noise(grads: dict[str, Tensor], model: nn.Module) -> tuple[dict[str, list[Tensor]], float]:
    """Each Bayesian layer's draw (weight, then bias) from the mean and scale gradients, and the share identified."""
    names = {id(p): n for n, p in model.named_parameters()}
    noise, found, total = {}, 0, 0
    for layer_name, layer in bayesian_layers(model).items():
        draws = []
        for mu, rho in layer.pairs():
            g_mu, g_rho = grads[names[id(mu)]], grads[names[id(rho)]]
            known = g_mu != 0
            slope = torch.sigmoid(rho.detach())
            draws.append(torch.where(known, g_rho / torch.where(known, g_mu, 1.0) / slope, torch.zeros_like(g_mu)))
            found, total = found + int(known.sum()), total + known.numel()
        noise[layer_name] = draws
    return noise, found / max(total, 1)


def deterministic_update(grads: dict[str, Tensor], model: nn.Module, plain: nn.Module) -> list[Tensor]:
    """The collapsed network's update: each Bayesian layer's ``dL/dW`` is its mean's gradient."""
    renamed = dict(grads)
    for layer_name in bayesian_layers(model):
        for part in ("weight", "bias"):
            if f"{layer_name}.{part}_mu" in grads:
                renamed[f"{layer_name}.{part}"] = grads[f"{layer_name}.{part}_mu"]
    return [renamed[n] for n in parameter_names(plain)]


class BayesianExact(InvertingGradients):
    """The sampled noise read exactly from the mean and scale gradients; Inverting Gradients on the fixed network."""

    name = "bayesian_exact"
    paper = "Chen et al. 2024"
    auto_params = {"cpu": {"iterations": 1000}, "cuda": {"iterations": 4800}}
    uses_defense = True
    needs_defense = True

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if why := _needs_bayesian_fedsgd(model, protocol, "bayesian_exact", " or bayesian_kl"):
            return why
        layers = bayesian_layers(model).values()
        if any(not rho.requires_grad for layer in layers for _, rho in layer.pairs()):
            return ("bayesian_exact: only the means are shared (share_scales: false), so the noise is not identifiable; "
                    "use bayesian_kl")
        if batch_size > 1 and any(layer.per_example for layer in layers):
            return ("bayesian_exact: each example draws its own noise (noise: per_example), and the batch's "
                    "gradient mixes the draws; use data.batch_size 1 or bayesian_kl")
        return None

    @staticmethod
    def collapsed(observed: SharedUpdate, threat: ThreatModel) -> tuple[SharedUpdate, ThreatModel, dict, float]:
        """The draws read from the gradients, and the update and threat model of the network fixed at them."""
        model = threat.model
        grads = data_gradients(observed, model, kl_weight_of(threat.defense))
        noise, identified = recover_noise(grads, model)
        plain = collapse(model, noise)
        update = SharedUpdate(deterministic_update(grads, model, plain), parameter_names(plain),
                              observed.batch_size, observed.metadata)
        return update, dataclasses.replace(threat, model=plain, defense=NoDefense()), noise, identified

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        update, plain, noise, identified = self.collapsed(observed, threat)
        result = super().reconstruct(update, plain, generator)
        result.extras.update(noise_identified=identified, noise=noise)
        return result

    @classmethod
    def reconstruct_all(cls, problems: list[Problem[Self]], max_problems: int | None = None) -> list[Reconstruction]:
        """Each problem's network fixed at its own draws, then Inverting Gradients on all of them together
        (the fixed networks share one architecture: their parameters are stacked, one set per problem)."""
        fixed, found = [], []
        for p in problems:
            update, plain, noise, identified = cls.collapsed(p.observed, p.threat)
            fixed.append(Problem(update, plain, p.generator, p.attack))
            found.append({"noise_identified": identified, "noise": noise})
        recs = InvertingGradients.reconstruct_all(cast(Any, fixed), max_problems)
        for rec, extras in zip(recs, found):
            rec.extras.update(extras)
        return recs


def kl_to_standard_normal(eps: Tensor) -> Tensor:
    """``KL(N(m, s^2) || N(0, 1))`` of the draws' empirical mean and std (Chen et al. 2024, appendix B)."""
    m, s = eps.mean(), eps.std()
    return 0.5 * (-torch.log(s ** 2) + s ** 2 + m ** 2 - 1)


class BayesianNoiseKL(InvertingGradients):
    """Image and weight noise optimised together; the noise is pulled to N(0, 1) by a KL term (Chen et al. 2024)."""

    name = "bayesian_kl"
    paper = "Chen et al. 2024"
    auto_params = {"cpu": {"iterations": 1000}, "cuda": {"iterations": 4800}}
    params = {**InvertingGradients.params,
              "alpha_kl": Param(1e-2, float, min=0.0, help="weight of the noise's KL regulariser")}
    alpha_kl: float
    uses_defense = True
    needs_defense = True

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        return _needs_bayesian_fedsgd(model, protocol, "bayesian_kl")

    def _extra_variables(self, threat: ThreatModel, generator: torch.Generator) -> dict[str, list[Tensor]]:
        """One draw per Bayesian layer's noise tensor, by layer name, optimised with the image."""
        return {name: [torch.randn(shape, generator=generator, device=threat.device).requires_grad_(True)
                       for shape in layer.noise_shapes(threat.batch_size)]
                for name, layer in bayesian_layers(threat.model).items()}

    def objective(self, images: Tensor, labels: Tensor, target: list[Tensor], unknowns: dict[str, list[Tensor]],
                  keep: list[bool] | None, model: nn.Module, plain: Plain,
                  prior: Callable[[Tensor], Tensor | float]) -> Tensor:
        """The cosine match with the layers' noise given as ``unknowns``, plus their KL to N(0, 1)."""
        with given_noise(model, unknowns):
            loss = super().objective(images, labels, target, unknowns, keep, model, plain, prior)
        return loss + self.alpha_kl * sum(kl_to_standard_normal(e) for draws in unknowns.values() for e in draws)

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        return _noise_extras(super().reconstruct(observed, threat, generator))

    @classmethod
    def reconstruct_all(cls, problems: list[Problem[Self]], max_problems: int | None = None) -> list[Reconstruction]:
        """Images and noise of like problems optimised together (the noise given to the layers per problem)."""
        return [_noise_extras(r) for r in super().reconstruct_all(problems, max_problems)]

    @classmethod
    def _can_vectorise(cls, threat: ThreatModel) -> bool:
        """The layers' noise is given (an unknown), so the model is a pure function of it: only hooks prevent it."""
        return not any(m._backward_hooks or m._backward_pre_hooks for m in threat.model.modules())


def _noise_extras(result: Reconstruction) -> Reconstruction:
    """The optimised noise of the kept restart, by layer, in the result's extras."""
    if "variables" in result.extras or "noise" not in result.extras:
        noise = result.extras.pop("variables", {})
        result.extras["noise"] = {n: [e.detach() for e in draws] for n, draws in noise.items()}
    return result


@hookimpl
def register_attacks():
    return [BayesianExact, BayesianNoiseKL]
