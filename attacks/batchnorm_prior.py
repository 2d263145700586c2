"""The BatchNorm-statistics prior: a candidate batch's per-layer feature statistics held to known ones.

Yin et al. 2021 (GradInversion, R_BN) hold them to the model's own running statistics, which every honest server
has (``model``); Hatamizadeh et al. 2023 to the statistics of the client's batch itself, which the server reads off
the BatchNorm buffers sent with the weights (``update``: ``plugins.protocol.sent_batch_statistics``). The penalty is
R_BN's: per layer, the L2 distance of the means plus that of the variances, summed over layers.
"""
from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn
from torch.func import functional_call

from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import RUNNING_BUFFERS, sent_batch_statistics, tracking_batchnorms

#: Where the prior's target statistics come from: none (no prior), the model's running statistics, or the batch's
#: own as the client's sent buffers give them.
SOURCES = ("none", "model", "update")


def batch_statistics(module: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor],
                     images: Tensor) -> list[Tensor]:
    """Per BatchNorm layer of ``module`` (in its order), the mean and unbiased variance of its input over all but the
    channel dimension, for ``images`` through ``functional_call``: [mean_0, var_0, ...], differentiable in
    ``images`` (and vmappable: the forward hooks only read)."""
    stats: list[Tensor] = []

    def record(_m: nn.Module, inputs: tuple[Tensor, ...]) -> None:
        x = inputs[0]
        dims = [d for d in range(x.dim()) if d != 1]
        stats.extend((x.mean(dims), x.var(dims, correction=1)))

    hooks = [m.register_forward_pre_hook(record) for m in module.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    try:
        functional_call(module, (params, buffers), (images,))
    finally:
        for h in hooks:
            h.remove()
    return stats


def model_statistics(model: nn.Module) -> list[Tensor]:
    """The model's running mean and variance per tracking BatchNorm layer: what an honest server holds."""
    return [cast(Tensor, b).detach().clone() for m in tracking_batchnorms(model) for b in (m.running_mean, m.running_var)]


def target_statistics(source: str, model: nn.Module, observed: SharedUpdate) -> list[Tensor]:
    """The statistics the prior holds a candidate to, from ``source`` (one of ``SOURCES`` but none); ValueError in
    one line where the update carries none (``update``) or the model has no BatchNorm layer keeping them."""
    if not tracking_batchnorms(model):
        raise ValueError(f"bn_prior: {source}: the model has no BatchNorm layer keeping running statistics")
    if source == "model":
        return model_statistics(model)
    sent = observed.metadata.get(RUNNING_BUFFERS)
    stats = None if sent is None else sent_batch_statistics(model, list(sent))
    if stats is None:
        raise ValueError("bn_prior: update: the update carries no BatchNorm statistics that moved (a defense that "
                         "computes its update itself, or the client's model in eval mode)")
    return stats


def statistics_distance(candidate: list[Tensor], target: list[Tensor]) -> Tensor:
    """R_BN (Yin et al. 2021): the sum over layers of ||mean - target mean|| + ||var - target var||; 0 at the
    target. Where the model has BatchNorm layers that keep no statistics, only those that do are compared: the
    candidate's list is of every BatchNorm layer, so the lengths agree only where all keep them (checked)."""
    if len(candidate) != len(target):
        raise ValueError(f"bn_prior: {len(candidate) // 2} BatchNorm layers in the model, {len(target) // 2} with "
                         "statistics; every BatchNorm layer must keep running statistics")
    return torch.stack([torch.linalg.vector_norm(c - t) for c, t in zip(candidate, target)]).sum()
