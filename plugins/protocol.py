"""What one client computes in one federated round, as types: FedSGD's gradient, FedAvg's
local-training delta, or the update a user's own training step makes.

Each protocol knows how the client computes its clean update (``client_update``) and how an
attacker models it for a candidate input (``attacker_update``, differentiable); the engine,
defenses and attacks ask the protocol instead of comparing names.
"""
from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from dataclasses import Field, dataclass, field, replace
from typing import Any, Callable, ClassVar, Iterator, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call

from leakaudit.plugins.factories import import_factory
from leakaudit.plugins.spec import Param

#: The loss a client differentiates: ``loss_fn(outputs, targets)`` -> a scalar tensor (targets are class indices or
#: soft labels).
LossFn = Callable[[Tensor, Tensor], Tensor]
#: Your own training step, as ``OwnStep`` calls it: ``train_step(model, inputs, labels)``; it updates the model.
StepFn = Callable[[nn.Module, Tensor, Tensor], Any]


#: The metadata key of the count of clients that sent each coordinate non-zero, per tensor, where secure
#: aggregation reveals it (``FedAvg.secure_aggregation: per_element``).
CONTRIBUTORS = "contributors"


class Protocol:
    """Base of the protocol types: how a client turns its private batch into the update it sends."""

    name: ClassVar[str]
    #: The protocol's YAML settings (``protocol: {name: ..., <key>: ...}``), checked before any work.
    params: ClassVar[dict[str, Param]] = {}
    #: Whether the sent tensors are (a multiple of) one gradient of the batch loss at the current
    #: weights, so that layer-wise and closed-form attacks, and gradient-level defenses, apply.
    sends_gradient: ClassVar[bool] = True
    #: Every protocol type is a frozen dataclass, so that ``dataclasses.replace`` sets its secure aggregation.
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    def client_update(self, model: nn.Module, loss_fn: LossFn, inputs: Tensor, labels: Tensor,
                      generator: torch.Generator | None = None) -> list[Tensor]:
        """The clean update the client computes on its batch (detached); ``generator`` is the client's own, for a
        protocol that draws (FedAvg's shuffle)."""
        return [g.detach() for g in self.attacker_update(model, loss_fn, inputs, labels, create_graph=False)]

    def client_updates(self, model: nn.Module, loss_fn: LossFn, inputs: Tensor, labels: Tensor,
                       generator: torch.Generator | None = None) -> list[list[Tensor]]:
        """Each client's clean update before aggregation (one client unless the protocol aggregates several)."""
        return [self.client_update(model, loss_fn, inputs, labels, generator)]

    def aggregate(self, sent: list[list[Tensor]]) -> tuple[list[Tensor], dict[str, Any]]:
        """What the server receives of the clients' ``sent`` updates, and what it learns with it (one client: its own)."""
        return sent[0], {}

    def one_client(self) -> Protocol:
        """The protocol of one of its clients alone (itself where one client sends the update)."""
        return self

    def attacker_update(self, model: nn.Module, loss_fn: LossFn, images: Tensor, targets: Tensor,
                        create_graph: bool = True) -> list[Tensor]:
        """The update the attacker models for candidate ``images``: FedSGD's gradient unless overridden."""
        return fedsgd_update(model, loss_fn, images, targets, create_graph)

    def functional_update(self, model: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor],
                          loss_fn: LossFn, images: Tensor, targets: Tensor) -> dict[str, Tensor]:
        """``attacker_update`` as a pure function of ``params`` (torch.func), so that it runs under ``vmap``:
        many candidate batches against one model at once. FedSGD's gradient unless overridden."""
        def loss(p: dict[str, Tensor]) -> Tensor:
            return loss_fn(functional_call(model, (p, buffers), (images,)), targets)

        return torch.func.grad(loss)(params)

    def gradient_scale(self, images: int) -> float:
        """The factor that turns the sent tensors back into a mean gradient (1 for a gradient)."""
        return 1.0

    def local_steps(self, images: int) -> int:
        """How many local SGD steps the client takes on ``images`` images."""
        return 1


def not_one_step(protocol: Protocol, images: int, attack: str) -> str | None:
    """Why ``attack``, which reads one gradient step, cannot read ``protocol``'s update of ``images``; None if it can."""
    steps = protocol.local_steps(images)
    if steps == 1:
        return None
    return (f"{attack} needs each client's update to be one gradient step ({protocol.name} takes {steps} local "
            "steps here; set local_batch_size and local_epochs so that each client steps once)")


@dataclass(frozen=True)
class FedSGD(Protocol):
    """The client sends the gradient of the mean loss over its whole batch."""

    name: ClassVar[str] = "fedsgd"


@dataclass(frozen=True)
class FedAvg(Protocol):
    """``local_epochs`` passes over the client's images in order, in minibatches of ``local_batch_size``
    (all images when None), SGD at ``local_lr``; the client sends ``theta_before - theta_after``
    (Geiping et al. 2020, Sec. 6). Attackers unroll the local steps.

    ``shuffle``: each epoch the client draws a new order of its images from its own generator, which the
    attacker does not see (Dimitrov et al. 2022); ``attacker_update`` still models the images in order.

    ``clients`` > 1 is secure aggregation: the update's images are shared out in order among that many
    clients, each trains from the same weights on its own, and the server sees only the mean of their
    updates (Bonawitz et al. 2017). Attackers unroll every client's steps and average them as the server does.

    ``secure_aggregation`` says what the server learns of clients' sparse updates (a defense that ``sparsifies``,
    applied by each client to its own): ``sum``, only their mean, zeros included (Bonawitz et al. 2017);
    ``per_element``, per coordinate the sum and the count of clients that sent it non-zero, the sum divided by
    that count (the per-element secure aggregation of Suimon et al. 2025, arXiv:2508.04285, at threshold 1: the
    count is revealed, so a coordinate one client alone sent is that client's value, exactly).
    """

    local_epochs: int = 1
    local_batch_size: int | None = None
    local_lr: float = 1e-4
    clients: int = 1
    shuffle: bool = False
    secure_aggregation: str = "sum"

    name: ClassVar[str] = "fedavg"
    params: ClassVar[dict[str, Param]] = {
        "local_epochs": Param(1, int, min=1, help="passes over the client's images"),
        "local_batch_size": Param(None, int, min=1, help="minibatch size (default: all images)"),
        "local_lr": Param(1e-4, float, min=0.0, exclusive_min=True, help="local SGD step size"),
        "clients": Param(1, int, min=1, max=4096, help="secure aggregation: the update is the mean of this many "
                                                      "clients' updates, data.batch_size images shared among them"),
        "shuffle": Param(False, bool, help="each epoch the client shuffles its images with its own seeded generator, "
                                           "an order the attacker does not know (Dimitrov et al. 2022); false: in "
                                           "order"),
        "secure_aggregation": Param("sum", str, choices=("sum", "per_element"),
                                    help="what the server learns of sparse updates: their mean (sum), or per "
                                         "coordinate the count of clients that sent it, each coordinate's sum "
                                         "divided by its count (per_element, Suimon et al. 2025)"),
    }
    sends_gradient: ClassVar[bool] = False

    def client_update(self, model: nn.Module, loss_fn: LossFn, inputs: Tensor, labels: Tensor,
                      generator: torch.Generator | None = None) -> list[Tensor]:
        """The clean update; under ``shuffle`` each client's epochs take orders drawn from ``generator``."""
        if not self.shuffle or generator is None:
            return super().client_update(model, loss_fn, inputs, labels, generator)
        each = self.client_updates(model, loss_fn, inputs, labels, generator)
        return [torch.stack(parts).mean(0) for parts in zip(*each)]

    def client_updates(self, model: nn.Module, loss_fn: LossFn, inputs: Tensor, labels: Tensor,
                       generator: torch.Generator | None = None) -> list[list[Tensor]]:
        """Each client's clean update on its share of the images (under ``shuffle``, orders from ``generator``)."""
        each = []
        for x, y in self.client_batches(inputs, labels):
            orders = self.epoch_orders(x, generator)
            each.append([g.detach() for g in fedavg_update(model, loss_fn, x, y, self, orders=orders)])
        return each

    def epoch_orders(self, images: Tensor, generator: torch.Generator | None) -> list[Tensor] | None:
        """Each local epoch's order of one client's ``images``, drawn from its ``generator`` under ``shuffle``;
        None (in order) otherwise."""
        if not self.shuffle or generator is None:
            return None
        return [torch.randperm(len(images), generator=generator, device=generator.device).to(images.device)
                for _ in range(self.local_epochs)]

    def minibatches(self, images: Tensor, targets: Tensor,
                    orders: list[Tensor] | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """One client's local steps' minibatches in training order: ``local_epochs`` passes over its images, each
        in ``orders[epoch]`` (None: in order), cut into ``local_batch_size``."""
        b = self.local_batch_size or len(images)
        for epoch in range(self.local_epochs):
            x, y = (images, targets) if orders is None else (images[orders[epoch]], targets[orders[epoch]])
            for i in range(0, len(images), b):
                yield x[i:i + b], y[i:i + b]

    def aggregate(self, sent: list[list[Tensor]]) -> tuple[list[Tensor], dict[str, Any]]:
        """``sum``: the mean of the clients' updates. ``per_element``: each coordinate's sum over the clients that
        sent it non-zero, divided by their count, which the server learns (``CONTRIBUTORS``)."""
        if self.secure_aggregation == "sum":
            return [torch.stack(parts).mean(0) for parts in zip(*sent)], {}
        counts = [torch.stack([p != 0 for p in parts]).sum(0) for parts in zip(*sent)]
        means = [torch.stack(parts).sum(0) / n.clamp_min(1) for parts, n in zip(zip(*sent), counts)]
        return means, {CONTRIBUTORS: counts}

    def attacker_update(self, model: nn.Module, loss_fn: LossFn, images: Tensor, targets: Tensor,
                        create_graph: bool = True) -> list[Tensor]:
        each = [fedavg_update(model, loss_fn, x, y, self, create_graph)
                for x, y in self.client_batches(images, targets)]
        return [torch.stack(parts).mean(0) for parts in zip(*each)]

    def functional_update(self, model: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor],
                          loss_fn: LossFn, images: Tensor, targets: Tensor) -> dict[str, Tensor]:
        each = [self._local(model, params, buffers, loss_fn, x, y) for x, y in self.client_batches(images, targets)]
        return {n: torch.stack([e[n] for e in each]).mean(0) for n in params}

    def one_client(self) -> Protocol:
        return replace(self, clients=1)

    def _local(self, model: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor], loss_fn: LossFn,
               images: Tensor, targets: Tensor) -> dict[str, Tensor]:
        """One client's ``theta_before - theta_after`` as a pure function of ``params``."""
        current = dict(params)
        for xb, yb in self.minibatches(images, targets):
            def loss(p: dict[str, Tensor], x: Tensor = xb, y: Tensor = yb) -> Tensor:
                return loss_fn(functional_call(model, (p, buffers), (x,)), y)

            grads = torch.func.grad(loss)(current)
            current = {n: p - self.local_lr * grads[n] for n, p in current.items()}
        return {n: params[n] - current[n] for n in params}

    def client_batches(self, images: Tensor, targets: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each client's images, in order: the batch cut in ``clients`` equal parts."""
        return list(zip(images.chunk(self.clients), targets.chunk(self.clients)))

    def gradient_scale(self, images: int) -> float:
        return 1.0 / (self.local_lr * self.local_steps(images))

    def local_steps(self, images: int) -> int:
        """Each client's local steps on its ``images / clients`` images."""
        mine = images // self.clients
        b = self.local_batch_size or mine
        return self.local_epochs * -(-mine // b)


@dataclass(frozen=True)
class OwnStep(Protocol):
    """The user's own training step ``function(model, inputs, labels)`` runs once; the client sends
    ``(theta_before - theta_after) / lr``, the gradient an SGD step at ``lr`` applied, and the
    attacker models it as FedSGD's gradient.
    """

    function: str | StepFn | None = None
    lr: float | None = None

    name: ClassVar[str] = "step"
    params: ClassVar[dict[str, Param]] = {
        "function": Param(type=str, help="'package.module:train_step', called as train_step(model, inputs, labels)"),
        "lr": Param(type=float, min=0.0, exclusive_min=True, help="the SGD step size of your step function"),
    }

    def step_function(self) -> StepFn:
        """The user's step callable (imported from ``package.module:function`` when given as text)."""
        if callable(self.function):
            return self.function
        if self.function is None:
            raise ValueError("protocol step: function is required ('package.module:train_step' or a callable)")
        return import_factory(self.function)

    def client_update(self, model: nn.Module, loss_fn: LossFn, inputs: Tensor, labels: Tensor,
                      generator: torch.Generator | None = None) -> list[Tensor]:
        if self.lr is None:
            raise ValueError("protocol step: lr is required (the SGD step size of your step function)")
        return captured_update(model, self.step_function(), inputs, labels, self.lr)


#: The protocol types by YAML name.
PROTOCOLS: dict[str, type[Protocol]] = {p.name: p for p in (FedSGD, FedAvg, OwnStep)}
FEDSGD = FedSGD()


def _opacus_wrapped(model: nn.Module) -> bool:
    """Whether Opacus wrapped the model (a ``GradSampleModule``): never where Opacus was not even imported,
    so that models leakaudit builds need not wait for its import."""
    if "opacus" not in sys.modules:
        return False
    from opacus import GradSampleModule

    return isinstance(model, GradSampleModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module of a model Opacus wrapped (``GradSampleModule``), its hooks removed; else ``model``.

    For models leakaudit builds; a user's live model goes through ``opacus_hooks_off``.
    """
    if _opacus_wrapped(model):
        wrapped: Any = model  # a GradSampleModule
        wrapped._close()
        return wrapped._module
    return model


@contextmanager
def quiet_hooks() -> Iterator[None]:
    """Silence the warning Opacus's backward hooks give when the inputs need no gradient (they need none)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        yield


@contextmanager
def opacus_hooks_off(model: nn.Module) -> Iterator[nn.Module]:
    """The plain module of a user's live model, with Opacus's per-sample hooks taken off (put back after):
    merely disabled, its backward hooks would still stop torch.func's vmap, which vectorised attacks use."""
    if not _opacus_wrapped(model):
        yield model
        return
    wrapped: Any = model  # a GradSampleModule
    was_enabled = wrapped.hooks_enabled
    wrapped.remove_hooks()
    try:
        yield wrapped._module
    finally:
        wrapped.add_hooks(loss_reduction=wrapped.loss_reduction, batch_first=wrapped.batch_first,
                          force_functorch=wrapped.force_functorch)
        if not was_enabled:
            wrapped.disable_hooks()


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a client shares, in the model's order."""
    return [p for p in model.parameters() if p.requires_grad]


def parameter_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def fedsgd_update(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor,
                  create_graph: bool = False) -> list[Tensor]:
    """The FedSGD update: gradient of the mean batch loss for every trainable parameter.

    With ``create_graph=True`` the result stays differentiable in ``inputs`` (and in
    soft ``targets``), which is what gradient-matching attacks optimise through.
    """
    loss = loss_fn(model(inputs), targets)
    return list(torch.autograd.grad(loss, trainable(model), create_graph=create_graph))


def fedavg_update(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, protocol: FedAvg,
                  create_graph: bool = False, orders: list[Tensor] | None = None) -> list[Tensor]:
    """``theta_before - theta_after`` of local SGD, unrolled so it can stay differentiable in ``inputs``;
    ``orders``: each epoch's order of the images (None: in order)."""
    names = parameter_names(model)
    start: dict[str, Tensor] = dict(zip(names, trainable(model)))
    current = dict(start)
    for x, y in protocol.minibatches(inputs, targets, orders):
        loss = loss_fn(functional_call(model, current, (x,)), y)
        # a parameter the candidate does not reach (the token embedding, where an attack feeds embeddings) takes no
        # step
        grads = torch.autograd.grad(loss, list(current.values()), create_graph=create_graph, allow_unused=True,
                                    materialize_grads=True)
        current = {n: p - protocol.local_lr * g for (n, p), g in zip(current.items(), grads)}
    return [start[n] - current[n] for n in names]


@torch.no_grad()
def _snapshot(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in trainable(model)]


def captured_update(model: nn.Module, step_fn: StepFn, inputs: Tensor, labels: Tensor, lr: float) -> list[Tensor]:
    """Run the user's ``step_fn`` once and return ``(theta_before - theta_after) / lr``.

    The parameters (and their ``.grad``) are put back afterwards, so the model is left as it
    was: the attacker attacks the state the update was computed at.
    """
    params = trainable(model)
    before, grads = _snapshot(model), [p.grad for p in params]
    step_fn(model, inputs, labels)
    after = _snapshot(model)
    with torch.no_grad():
        for p, b, g in zip(params, before, grads):
            p.copy_(b)
            p.grad = g
    return [(b - a) / lr for b, a in zip(before, after)]


@dataclass
class ClientStep:
    """One client's round: its model, loss, private batch, protocol and a seeded generator for the defense."""

    model: nn.Module
    loss_fn: LossFn
    inputs: Tensor
    labels: Tensor
    generator: torch.Generator
    protocol: Protocol = field(default=FEDSGD)

    def clean_update(self) -> list[Tensor]:
        """The update before any defense touches it."""
        return self.protocol.client_update(self.model, self.loss_fn, self.inputs, self.labels, self.generator)


@dataclass
class TrainingRun:
    """Utility training: normalised training images on the device, the SGD settings, and seeded generators.

    ``batch_generator`` (CPU) draws the batches; ``noise_generator`` (on the device) draws the defense's noise.
    """

    inputs: Tensor
    labels: Tensor
    loss_fn: LossFn
    steps: int
    batch_size: int
    lr: float
    momentum: float
    batch_generator: torch.Generator
    noise_generator: torch.Generator
    protocol: Protocol = field(default=FEDSGD)
    #: Applied to every drawn batch: an augmenting defense's ``augment``, in normalised space.
    transform: Callable[[Tensor], Tensor] | None = None

    def batch(self) -> tuple[Tensor, Tensor]:
        """A batch of ``batch_size`` examples drawn uniformly with replacement, through ``transform``."""
        idx = torch.randint(len(self.inputs), (self.batch_size,), generator=self.batch_generator)
        idx = idx.to(self.inputs.device)
        x = self.inputs[idx]
        return (self.transform(x) if self.transform else x), self.labels[idx]

    @property
    def sample_rate(self) -> float:
        return opacus_sample_rate(len(self.inputs), self.batch_size)


def opacus_sample_rate(examples: int, batch_size: int) -> float:
    """Opacus's sampling rate for ``examples`` in batches of ``batch_size``: 1 / batches per epoch."""
    return 1.0 / -(-examples // batch_size)


#: The key of ``SharedUpdate.metadata`` under which a client's BatchNorm running buffers travel with its update: per
#: tracking BatchNorm layer in the model's order, its running mean, running variance and batch count after the round
#: (what Flower's and FLARE's full state_dict carries beside the weights).
RUNNING_BUFFERS = "batchnorm_buffers"


def tracking_batchnorms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers that keep running statistics, in the model's order."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            and m.running_mean is not None and m.running_var is not None and m.num_batches_tracked is not None]


def running_buffers(model: nn.Module) -> list[Tensor]:
    """Copies of every tracking BatchNorm layer's running mean, running variance and batch count, layer by layer."""
    return [cast(Tensor, b).detach().clone() for m in tracking_batchnorms(model)
            for b in (m.running_mean, m.running_var, m.num_batches_tracked)]


@torch.no_grad()
def load_running_buffers(model: nn.Module, buffers: list[Tensor]) -> None:
    """Put ``running_buffers``'s list back into the model's BatchNorm layers."""
    for m, (mean, var, count) in zip(tracking_batchnorms(model), zip(*[iter(buffers)] * 3)):
        cast(Tensor, m.running_mean).copy_(mean)
        cast(Tensor, m.running_var).copy_(var)
        cast(Tensor, m.num_batches_tracked).copy_(count)


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Whatever runs inside leaves the model's BatchNorm running statistics as they were (a client's round, an
    attacker's forward passes in train mode): the server's copy of the model is not the client's."""
    before = running_buffers(model)
    try:
        yield
    finally:
        load_running_buffers(model, before)


def sent_batch_statistics(model: nn.Module, sent: list[Tensor]) -> list[Tensor] | None:
    """Per tracking BatchNorm layer, the mean and the unbiased variance of its inputs that the server reads off the
    buffers a client ``sent`` (``running_buffers`` after its round) and its own copy of ``model``'s (before it):
    [mean_0, var_0, mean_1, ...]; None where the buffers did not move (the client's model in eval mode).

    With momentum m over k local steps, running = (1 - m)^k before + sum_j m (1 - m)^(k - j) batch_j, so the
    statistic read is that weighted mean of the k steps' batch statistics: exactly the batch's own where the client
    steps once (FedSGD; FedAvg with one local step), a mix weighted towards the last steps otherwise. With
    momentum None (a cumulative average) the k steps weigh equally. Computed in float64 (it divides by m)."""
    layers = tracking_batchnorms(model)
    if len(sent) != 3 * len(layers) or not layers:
        return None
    out: list[Tensor] = []
    for m, (mean, var, count) in zip(layers, zip(*[iter(sent)] * 3)):
        before = int(cast(Tensor, m.num_batches_tracked))
        after = int(count)
        steps = after - before
        if steps <= 0:
            return None
        old = [cast(Tensor, b).double() for b in (m.running_mean, m.running_var)]
        new = [mean.double(), var.double()]
        if m.momentum is None:
            read = [(after * n - before * o) / steps for n, o in zip(new, old)]
        else:
            decay = (1 - m.momentum) ** steps
            read = [(n - decay * o) / (1 - decay) for n, o in zip(new, old)]
        out.extend(r.to(mean.dtype) for r in read)
    return out
