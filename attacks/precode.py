"""The attack on PRECODE that recovers the bottleneck's sample, then matches gradients.

For one image the decoder ``z = D b + c`` gives ``dL/dD = delta b^T`` and ``dL/dc = delta``,
so the sample ``b`` is read off in closed form, as the input of any biased fully connected
layer is. With ``b`` known the noise is no longer unknown: a candidate ``x`` implies
``eps = (b - mu(x)) / scale(x)``, held constant, and its update is exactly the client's
when ``x`` is the client's image. Cosine matching (Inverting Gradients) then runs on that
deterministic network. On an MLP the plain ``analytic`` attack already inverts the first
layer exactly; this attack is the one for convolutional networks with a bottleneck.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, cast

import torch
from torch import Tensor, nn
from typing_extensions import Self

from leakaudit.attacks.analytic import solve_input
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.defenses.precode import VariationalBottleneck, bottleneck_of, pinned_sample
from leakaudit.plugins import hookimpl
from leakaudit.plugins.attack import Problem, Reconstruction, ThreatModel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import Protocol

def _bottleneck(model: nn.Module) -> VariationalBottleneck:
    """The model's bottleneck (``unsupported`` refuses a model without one)."""
    found = bottleneck_of(model)
    if found is None:
        raise ValueError("the model has no PRECODE bottleneck")
    return found


def recover_sample(observed: SharedUpdate, model: nn.Module) -> Tensor:
    """The bottleneck sample ``b`` (1, K) from the decoder's weight and bias gradients."""
    decoder = _bottleneck(model).decoder
    names = {id(p): n for n, p in model.named_parameters()}
    grads = dict(zip(observed.names, observed.tensors))
    gw, gb = grads[names[id(decoder.weight)]], grads[names[id(decoder.bias)]]
    return solve_input(gw.double(), gb.double()).to(gw.dtype).unsqueeze(0)


class PrecodeSample(InvertingGradients):
    """Bottleneck sample from the decoder's gradients, then Inverting Gradients with that sample pinned."""

    name = "precode_sample"
    paper = "Balunovic et al. 2022"
    auto_params = {"cpu": {"iterations": 1000}, "cuda": {"iterations": 4800}}
    uses_defense = True
    needs_defense = True

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if bottleneck_of(model) is None:
            return "precode_sample: the model has no PRECODE bottleneck (defense precode)"
        if batch_size != 1 or not protocol.sends_gradient:
            return ("precode_sample: the decoder's gradient gives the sample for one image under FedSGD only "
                    "(data.batch_size 1, protocol fedsgd)")
        return None

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        sample = recover_sample(observed, threat.model).to(threat.device)
        with pinned_sample(threat.model, sample):
            result = super().reconstruct(observed, threat, generator)
        result.extras["sample"] = sample
        return result

    @classmethod
    def reconstruct_all(cls, problems: list[Problem[Self]], max_problems: int | None = None) -> list[Reconstruction]:
        """Each problem's sample pinned in its own copy of the network, then Inverting Gradients on all of them
        together (the copies' pinned samples are stacked, one per problem)."""
        pinned, samples = [], []
        for p in problems:
            sample = recover_sample(p.observed, p.threat.model).to(p.threat.device)
            model = copy.deepcopy(p.threat.model)
            _bottleneck(model).pinned = sample
            pinned.append(Problem(p.observed, dataclasses.replace(p.threat, model=model), p.generator, p.attack))
            samples.append(sample)
        recs = InvertingGradients.reconstruct_all(cast(Any, pinned), max_problems)
        for rec, sample in zip(recs, samples):
            rec.extras["sample"] = sample
        return recs


@hookimpl
def register_attacks():
    return [PrecodeSample]
