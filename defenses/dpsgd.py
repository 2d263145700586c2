"""DP-SGD (Abadi et al. 2016) as Opacus computes it: per-sample clipping, Gaussian noise, averaging.

The shared update is Opacus's own noisy gradient (``GradSampleModule`` for per-sample
gradients, ``DPOptimizer`` for clipping, noise and scaling), not a re-implementation; under
FedAvg, the client's local epochs of it, each minibatch's noisy gradient an SGD step.
The likelihood is the Gaussian around the mean of the per-sample clipped gradients of
the candidate inputs (under FedAvg, the noise-free local steps made of them), computed differentiably
with torch.func, so ``bayes`` attacks DP-SGD with its p(g|x). Epsilon comes from Opacus's accountants.
Opacus is imported where it is used: listing or validating plugins need not wait for it.
"""
from __future__ import annotations

import copy
import itertools
import math
import warnings
from typing import Any, Iterator, Sequence, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import Defense, PrivacyProfile, SharedUpdate, squared_distance
from leakaudit.plugins.protocol import (
    FEDSGD,
    ClientStep,
    FedAvg,
    FedSGD,
    OwnStep,
    Protocol,
    TrainingRun,
    parameter_names,
    quiet_hooks,
    trainable,
)
from leakaudit.plugins.text import example_shares

ACCOUNTANTS = ("rdp", "prv", "gdp")


class DPSGD(Defense):
    """One DP-SGD step per round: clip each example's gradient to ``max_grad_norm``, add
    N(0, (noise_multiplier * max_grad_norm)^2) to the sum, divide by the batch size. Under FedAvg the client
    takes its local epochs of such steps, one per minibatch at ``local_lr``, and sends ``theta_before - theta_after``.

    With ``target_epsilon`` the noise multiplier is solved by Opacus's
    ``get_noise_multiplier`` for ``delta``, ``steps`` and ``sample_rate``.
    """

    name = "dpsgd"
    modalities = ("image", "text")
    paper = "Abadi et al. 2016"
    mirrors_dp_optimizer = True
    params = {
        "noise_multiplier": Param(1.0, float, min=0.0, protects="higher", help="noise std as a multiple of max_grad_norm"),
        "max_grad_norm": Param(1.0, float, min=0.0, exclusive_min=True, help="per-example clipping norm C"),
        "target_epsilon": Param(None, float, min=0.0, exclusive_min=True,
                                help="solve noise_multiplier for this epsilon (needs steps and sample_rate)"),
        "delta": Param(1e-5, float, min=0.0, max=1.0, exclusive_min=True, help="delta of target_epsilon"),
        "steps": Param(None, int, min=1, help="training steps target_epsilon is spent over"),
        "sample_rate": Param(None, float, min=0.0, max=1.0, exclusive_min=True,
                             help="batch size / training set size, for target_epsilon"),
        "accountant": Param("rdp", str, choices=ACCOUNTANTS, help="Opacus accountant for epsilon"),
    }
    noise_multiplier: float
    max_grad_norm: float
    target_epsilon: float | None
    delta: float
    steps: int | None
    sample_rate: float | None
    accountant: str

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        if self.target_epsilon is not None:
            if self.steps is None or self.sample_rate is None:
                raise ValueError("dpsgd: target_epsilon needs steps and sample_rate")
            from opacus.accountants.utils import get_noise_multiplier

            self.noise_multiplier = get_noise_multiplier(
                target_epsilon=self.target_epsilon, target_delta=self.delta, sample_rate=self.sample_rate,
                steps=self.steps, accountant=self.accountant)
        self.protocol: Protocol = FEDSGD  # the protocol the likelihood and the guarantee read (``under``)

    def under(self, protocol: Protocol) -> DPSGD:
        """A copy that reads ``protocol``'s local steps in ``log_likelihood`` and ``privacy_profile``."""
        bound = copy.copy(self)
        bound.protocol = protocol
        return bound

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Make the model Opacus-compatible (BatchNorm to GroupNorm, no in-place activations)."""
        from opacus.validators import ModuleValidator

        self.model_changes = [str(e) for e in ModuleValidator.validate(model, strict=False)]
        if not self.model_changes:
            return model
        fixed = ModuleValidator.fix(model)
        for m in fixed.modules():
            if getattr(m, "inplace", False):
                m.inplace = False
        return fixed

    def unsupported(self, protocol: Protocol) -> str | None:
        if isinstance(protocol, (FedSGD, FedAvg)):
            return None
        if isinstance(protocol, OwnStep):
            return ("dpsgd computes the update itself with Opacus, so it cannot wrap your own step; "
                    "audit a step that does DP-SGD with defense none, or use protocol: fedsgd or fedavg")
        return f"dpsgd computes FedSGD's and FedAvg's updates only, not protocol {protocol.name}'s"

    def share(self, step: ClientStep) -> SharedUpdate:
        """Opacus's noisy gradient (FedSGD), or the mean over the clients of their local DP-SGD's change (FedAvg)."""
        protocol = step.protocol
        if not isinstance(protocol, FedAvg):
            sent = opacus_noisy_gradient(step.model, step.loss_fn, step.inputs, step.labels,
                                         self.noise_multiplier, self.max_grad_norm, step.generator)
            return SharedUpdate(sent, parameter_names(step.model), len(step.inputs), {"protocol": "fedsgd"})
        each = [dp_local_update(step.model, step.loss_fn, x, y, protocol, self.noise_multiplier, self.max_grad_norm,
                                step.generator) for x, y in protocol.client_batches(step.inputs, step.labels)]
        sent = [torch.stack(parts).mean(0) for parts in zip(*each)]
        return SharedUpdate(sent, parameter_names(step.model), len(step.inputs), {"protocol": protocol.name})

    def train(self, model: nn.Module, run: TrainingRun) -> Iterator[nn.Module]:
        """DP-SGD with Opacus's PrivacyEngine: Poisson-sampled batches, per-sample clipping, noise."""
        loader = DataLoader(TensorDataset(run.inputs, run.labels), batch_size=run.batch_size,
                            generator=run.batch_generator)
        from opacus import PrivacyEngine

        with warnings.catch_warnings():  # its draws are the audit's seeded ones by design: nothing to act on
            warnings.filterwarnings("ignore", "Secure RNG turned off", UserWarning)
            engine = PrivacyEngine(accountant=self.accountant)
        model.train()
        hooks, optimiser, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(trainable(model), lr=run.lr, momentum=run.momentum),
            data_loader=loader, noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
            noise_generator=run.noise_generator, wrap_model=False)
        epochs = itertools.chain.from_iterable(itertools.repeat(loader))  # a fresh Poisson pass each time round
        try:
            for x, y in itertools.islice(epochs, run.steps):
                yield model
                optimiser.zero_grad(set_to_none=True)
                with quiet_hooks():
                    run.loss_fn(model(x), y).backward()
                optimiser.step()
            yield model
        finally:
            hooks.cleanup()

    def candidate_update(self, threat, images: Tensor, labels: Tensor) -> list[Tensor]:
        """The mean of the candidate batch's per-example clipped gradients; under FedAvg, the noise-free local
        DP-SGD steps made of them (``clipped_local_update``). Differentiable in ``images``."""
        if isinstance(threat.protocol, FedAvg):
            return clipped_local_update(threat.model, threat.loss_fn, images, labels, threat.protocol,
                                        self.max_grad_norm)
        return clipped_mean_gradient(threat.model, threat.loss_fn, images, labels, self.max_grad_norm)

    def noise_std(self, images: int) -> float:
        """The per-coordinate std of the noise on an update of ``images`` images: ``noise_multiplier *
        max_grad_norm / B`` of one step; under FedAvg, ``local_lr`` times the root of the sum over the local steps
        of that step's variance (``local_lr * noise_multiplier * max_grad_norm / b * sqrt(steps)`` where the
        minibatch size b divides each client's images), over the root of the number of clients averaged."""
        scale = self.noise_multiplier * self.max_grad_norm
        protocol = self.protocol
        if not isinstance(protocol, FedAvg):
            return scale / images
        mine = images // protocol.clients
        b = protocol.local_batch_size or mine
        rest = mine % b
        per_epoch = (mine // b) / b ** 2 + (1 / rest ** 2 if rest else 0.0)
        return protocol.local_lr * scale * math.sqrt(protocol.local_epochs * per_epoch / protocol.clients)

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """Gaussian with std ``noise_std`` around the candidate: FedSGD's exact p(g|x). Under FedAvg an
        approximation: each step's noise moves the weights the later steps are taken at, so it reaches the update
        through the model's Jacobians, and the sum of the steps' independent Gaussians is exact to first order in
        ``local_lr`` only."""
        std = self.noise_std(observed.batch_size)
        if std == 0:
            return -0.5 * squared_distance(observed.tensors, candidate)
        return -squared_distance(observed.tensors, candidate) / (2 * std ** 2)

    def privacy_spent(self, steps: int, sample_rate: float, delta: float) -> float | None:
        """Epsilon at ``delta`` after ``steps`` at ``sample_rate``, from the configured Opacus accountant."""
        if self.noise_multiplier == 0:
            return float("inf")
        from opacus.accountants import create_accountant

        accountant = create_accountant(self.accountant)
        accountant.history = [(self.noise_multiplier, sample_rate, steps)]
        return float(accountant.get_epsilon(delta=delta))


    def privacy_profile(self, radius: float | None = None) -> PrivacyProfile:
        """One DP-SGD step with the target in its batch beside the same step without it: each example's clipped
        gradient moves the noisy sum by at most ``max_grad_norm``, against noise of ``noise_multiplier`` times
        that, so ``1 / noise_multiplier``-GDP (Dong et al. 2022). The sampling and composition that Opacus's
        accountant credits over training do not apply to the attacked update, which holds the target.

        Under FedAvg the target sits in one minibatch of each local epoch: ``local_epochs`` such steps composed
        adaptively, ``sqrt(local_epochs) / noise_multiplier``-GDP (Dong et al. 2022, Cor. 3.3); the steps without
        it, the other clients' updates and the sum sent are post-processing."""
        epochs = self.protocol.local_epochs if isinstance(self.protocol, FedAvg) else 1
        mu = math.inf if self.noise_multiplier == 0 else math.sqrt(epochs) / self.noise_multiplier
        steps = "one DP-SGD step" if epochs == 1 else f"{epochs} local DP-SGD steps holding the target"
        return PrivacyProfile(mu=mu, mechanism=f"Gaussian mechanism of {steps}: noise multiplier "
                                               f"{self.noise_multiplier:g}, each example clipped to "
                                               f"{self.max_grad_norm:g}")


def opacus_noisy_gradient(model: nn.Module, loss_fn, inputs: Tensor, labels: Tensor, noise_multiplier: float,
                          max_grad_norm: float, generator: torch.Generator) -> list[Tensor]:
    """The averaged noisy gradient Opacus's DPOptimizer makes for this batch (model left unchanged)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    params = trainable(model)
    saved = [p.grad for p in params]
    wrapped = GradSampleModule(model, loss_reduction="mean")
    try:
        optimiser = DPOptimizer(torch.optim.SGD(params, lr=0.0), noise_multiplier=noise_multiplier,
                                max_grad_norm=max_grad_norm, expected_batch_size=len(inputs),
                                loss_reduction="mean", generator=generator)
        optimiser.zero_grad(set_to_none=True)
        with quiet_hooks():
            loss_fn(wrapped(inputs), labels).backward()
        optimiser.pre_step()
        sent = [cast(Tensor, p.grad).detach().clone() for p in params]  # pre_step set every noisy gradient
        optimiser.zero_grad(set_to_none=True)
    finally:
        wrapped._close()
        for p, g in zip(params, saved):
            p.grad = g
    return sent


def dp_local_update(model: nn.Module, loss_fn, inputs: Tensor, labels: Tensor, protocol: FedAvg,
                    noise_multiplier: float, max_grad_norm: float, generator: torch.Generator) -> list[Tensor]:
    """One FedAvg client's ``theta_before - theta_after`` of local DP-SGD on a copy of ``model``: per minibatch (in
    the protocol's order, shuffled from ``generator`` as its clean update is) Opacus's noisy gradient, then SGD at
    ``local_lr``."""
    local = copy.deepcopy(model)
    params = trainable(local)
    before = [p.detach().clone() for p in params]
    for x, y in protocol.minibatches(inputs, labels, protocol.epoch_orders(inputs, generator)):
        noisy = opacus_noisy_gradient(local, loss_fn, x, y, noise_multiplier, max_grad_norm, generator)
        with torch.no_grad():
            for p, g in zip(params, noisy):
                p.sub_(protocol.local_lr * g)
    return [b - p.detach() for b, p in zip(before, params)]


def clipped_local_update(model: nn.Module, loss_fn, images: Tensor, labels: Tensor, protocol: FedAvg,
                         max_grad_norm: float) -> list[Tensor]:
    """FedAvg's update of noise-free local DP-SGD for candidate ``images``: each client's minibatches in order, each a
    step of their clipped mean gradient at ``local_lr``, unrolled with torch.func (differentiable); the clients'
    changes averaged."""
    names = parameter_names(model)
    each = []
    for x, y in protocol.client_batches(images, labels):
        start: dict[str, Tensor] = dict(zip(names, trainable(model)))
        current = dict(start)
        for xb, yb in protocol.minibatches(x, y):
            grads = clipped_mean_gradient(model, loss_fn, xb, yb, max_grad_norm, current)
            current = {n: p - protocol.local_lr * g for (n, p), g in zip(current.items(), grads)}
        each.append([start[n] - current[n] for n in names])
    return [torch.stack(parts).mean(0) for parts in zip(*each)]


def clipped_mean_gradient(model: nn.Module, loss_fn, inputs: Tensor, labels: Tensor,
                          max_grad_norm: float, at: dict[str, Tensor] | None = None) -> list[Tensor]:
    """Mean over the batch of each example's gradient scaled by min(1, C / ||g_i||); torch.func, differentiable.
    A language model's example gradient is its share of the batch's mean loss (``example_shares``), as Opacus's.
    ``at``: the trainable parameters by name to take it at (None: the model's own)."""
    names = parameter_names(model)
    params: dict[str, Tensor] = dict(zip(names, trainable(model))) if at is None else at
    frozen = {k: v for k, v in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items()
              if k not in params}

    def example_loss(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        out = functional_call(model, {**frozen, **p}, (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    per_example = vmap(grad(example_loss), in_dims=(None, 0, 0))(params, inputs, labels)
    grads = [per_example[n] for n in names]
    shares = example_shares(labels)  # a sequence's examples weigh by their positions, as Opacus's gradients do
    if shares is not None:
        grads = [g * shares.view(-1, *([1] * (g.dim() - 1))) for g in grads]
    norms = torch.sqrt(cast(Tensor, sum(g.flatten(1).pow(2).sum(1) for g in grads)))
    factor = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return [(g * factor.view(-1, *([1] * (g.dim() - 1)))).mean(0) for g in grads]


@hookimpl
def register_defenses():
    return [DPSGD]
