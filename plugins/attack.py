"""The ``Attack`` contract and what the attacker knows (``ThreatModel``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import Tensor, nn
from typing_extensions import Self

from leakaudit.plugins.defense import ALONE, FULL, Defense, OwnCoordinates, SharedUpdate
from leakaudit.plugins.protocol import FEDSGD, LossFn, Protocol, trainable
from leakaudit.plugins.spec import Param, resolve_params
from leakaudit.plugins.stochastic import noise_from

@dataclass(frozen=True)
class AuxiliaryData:
    """Images the attacker owns, in pixel space [0, 1] on the CPU, with their labels: the rows ``indices`` of
    ``images`` (the training split without the audit's targets). Attacks that learn from data draw from it."""

    images: Tensor
    labels: Tensor
    indices: Tensor

    def __len__(self) -> int:
        return len(self.indices)

    def draw(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``count`` distinct images and their labels, drawn with a CPU ``generator``."""
        pick = self.indices[torch.randperm(len(self.indices), generator=generator)[:count]]
        return self.images[pick], self.labels[pick]


@dataclass
class ThreatModel:
    """The honest-but-curious server's knowledge: white-box model, loss, data format and the defense."""

    model: nn.Module
    loss_fn: LossFn
    input_shape: tuple[int, ...]  # (C, H, W) of an image, (T,) of token ids
    mean: Tensor
    std: Tensor
    num_classes: int
    batch_size: int
    defense: Defense
    labels: Tensor | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    protocol: Protocol = FEDSGD
    #: The attacker's own images (None: it has none), for attacks that learn from data.
    auxiliary: AuxiliaryData | None = None

    _hoisted: tuple[tuple, list[Tensor] | None] | None = field(default=None, init=False, repr=False, compare=False)

    def candidate_update(self, images: Tensor, targets: Tensor) -> list[Tensor]:
        """The clean update that normalised ``images`` with ``targets`` would produce, differentiably.

        The loss is the client's: the task loss plus any term the defense trains with; a term of the parameters
        alone enters as its gradient, computed once while the weights stay as they are (``parameter_gradient``).
        """
        hoisted = self._parameter_gradient()
        loss_fn = self.defense.client_loss(self.model, self.loss_fn) if hoisted is None else self.loss_fn
        update = self.protocol.attacker_update(self.model, loss_fn, images, targets, create_graph=True)
        return update if hoisted is None else [u + h for u, h in zip(update, hoisted)]

    def _parameter_gradient(self) -> list[Tensor] | None:
        """``parameter_gradient`` of this threat, kept while the weights' version counters stay the same."""
        if type(self.defense).parameter_term is Defense.parameter_term:  # no such term: nothing to keep per call
            return None
        key = (id(self.defense), self.protocol, tuple((id(p), p._version) for p in trainable(self.model)))
        if self._hoisted is None or self._hoisted[0] != key:
            self._hoisted = key, parameter_gradient(self.model, self.defense, self.protocol)
        return self._hoisted[1]

    def normalise(self, pixels: Tensor) -> Tensor:
        return (pixels - self.mean) / self.std

    def to_pixels(self, images: Tensor) -> Tensor:
        return (images * self.std + self.mean).clamp(0, 1)

    def box(self) -> tuple[Tensor, Tensor]:
        """Bounds of valid images in normalised space (pixel range [0, 1])."""
        return self.normalise(torch.zeros_like(self.mean)), self.normalise(torch.ones_like(self.mean))


def parameter_gradient(model: nn.Module, defense: Defense, protocol: Protocol) -> list[Tensor] | None:
    """The gradient of the defense's parameter-only loss term (``Defense.parameter_term``) in each trainable
    parameter, where the protocol sends the plain gradient at the weights (FedSGD); None elsewhere.

    It is the same for every candidate image: an attacker adds it to the task loss's gradient once, instead of
    differentiating the term twice per iteration (42% of an iteration on the Bayesian ResNet-18, docs/results.md).
    """
    plain = type(protocol).attacker_update is Protocol.attacker_update and \
        type(protocol).functional_update is Protocol.functional_update
    if not plain:
        return None
    params = trainable(model)
    with torch.enable_grad():
        term = defense.parameter_term(model)
        if not isinstance(term, Tensor) or not term.requires_grad:  # none, or of frozen parameters only
            return None
        grads = torch.autograd.grad(term, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]


def seed_from(generator: torch.Generator) -> int:
    """A seed drawn from ``generator``, so that what it seeds stays one of the problem's own draws."""
    return int(torch.randint(0, 2 ** 62, (1,), generator=generator, device=generator.device))


def generator_on(device: torch.device, generator: torch.Generator) -> torch.Generator:
    """A generator on ``device`` seeded from ``generator`` (draws there need one there; the problem's own
    generator stays the source of every draw)."""
    return torch.Generator(device=device).manual_seed(seed_from(generator))


A = TypeVar("A", bound="Attack")


@dataclass
class Problem(Generic[A]):
    """One independent reconstruction: a shared update, what the attacker knows, the problem's own
    generator (its start and every later draw) and the configured attack that solves it (of type ``A``:
    an attack's ``reconstruct_all`` receives problems of its own class)."""

    observed: SharedUpdate
    threat: ThreatModel
    generator: torch.Generator
    attack: A


def alone_coordinates(update: SharedUpdate) -> int | None:
    """How many coordinates of ``update`` its first client alone sent, where the aggregate reveals each
    coordinate's contributors (``ALONE``); None where it does not (one client, or the plain mean)."""
    alone = update.metadata.get(ALONE)
    return None if alone is None else int(sum(int(m.sum()) for m in alone))


def own_coordinates_problem(problem: Problem[A]) -> Problem[A] | None:
    """The audited client's problem read from the coordinates it alone sent, where the aggregate reveals them
    (``ALONE``): the aggregate there is that client's own update (Suimon et al. 2025), matched exactly against the
    candidate update of that client's images alone. None where the update reveals none, where no coordinate had
    one contributor, or where the defense is random (its noise would make the exact match wrong)."""
    observed, threat = problem.observed, problem.threat
    alone = observed.metadata.get(ALONE)
    if alone is None or not threat.defense.deterministic or not alone_coordinates(observed):
        return None
    images = observed.batch_size // getattr(threat.protocol, "clients", 1)
    own = SharedUpdate([t * m for t, m in zip(observed.tensors, alone)], observed.names, images,
                       {"protocol": observed.metadata.get("protocol"), ALONE: alone})
    labels = None if threat.labels is None else threat.labels[:images]
    return replace(problem, observed=own, threat=replace(threat, protocol=threat.protocol.one_client(),
                                                         batch_size=images, defense=OwnCoordinates(), labels=labels))


@dataclass
class Reconstruction:
    """An attack's answer: images in [0, 1] pixel space, labels, loss trace and wall time."""

    images: Tensor
    labels: Tensor
    loss_trace: list[float]
    seconds: float
    extras: dict[str, Any] = field(default_factory=dict)


#: The most iterations an attack may be given: a budget past this never finishes on one machine.
MAX_ITERATIONS = 1_000_000


#: The attackers of Carletti et al.'s (2025) taxonomy, weakest first (with a server that reads the BatchNorm buffers
#: sent beside the weights, as Flower's and FLARE's full state_dict carries them: Hatamizadeh et al. 2023), each
#: with what it holds: an attack declares the least of them it needs (``Attack.attacker``), and a verdict holds
#: against that attacker.
EAVESDROPPER = "eavesdropper on the update"
HONEST_SERVER = "honest-but-curious server"
SERVER_READING_STATISTICS = "server reading BatchNorm statistics"
SERVER_WITH_MEMORY = "server with memory"
MALICIOUS_SERVER = "malicious server"
ATTACKERS = {
    EAVESDROPPER: "sees a client's shared update (and the model every client is sent), nothing more",
    HONEST_SERVER: "runs the protocol as agreed, and reads each update with the model's weights, the clients' "
                   "training settings and data of its own",
    SERVER_READING_STATISTICS: "an honest-but-curious server that also reads the BatchNorm running statistics a "
                               "client sends with its weights",
    SERVER_WITH_MEMORY: "an honest-but-curious server that keeps every earlier update (and so undoes an "
                        "optimizer's momentum)",
    MALICIOUS_SERVER: "changes the model or the protocol it sends (trap weights, imprint layers) to make the "
                      "updates leak",
}


class Attack:
    """Base class: subclasses set ``name``, ``params``, ``attacker`` and implement ``reconstruct``."""

    name: ClassVar[str]
    params: ClassVar[dict[str, Param]] = {}
    #: The paper the attack comes from (author, year), shown by ``leakaudit plugins``.
    paper: ClassVar[str] = ""
    #: The examples the attack reconstructs: "image" (pixels) or "text" (token sequences).
    modality: ClassVar[str] = "image"
    #: The least attacker the attack needs, one of ``ATTACKERS`` (Carletti et al. 2025): its verdicts hold
    #: against that attacker. "" where a plugin declares none (shown as undeclared).
    attacker: ClassVar[str] = ""
    #: The kinds of update the attack reads (``UPDATE_KINDS`` of leakaudit.plugins.defense): a defense's "protects"
    #: is calibrated only by an attack that reads the kind the defense shares (``Defense.shares``).
    reads: ClassVar[tuple[str, ...]] = (FULL,)

    def __init__(self, **settings: Any) -> None:
        self.settings = resolve_params(self.params, settings, self.name)
        for key, value in self.settings.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return f"{type(self).__name__}({args})"

    def __call__(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        """Run ``reconstruct`` and time it."""
        start = time.perf_counter()
        with noise_from(threat.model, generator):  # the model's own noise, if any, is the attacker's draw
            result = self.reconstruct(observed, threat, generator)
        result.seconds = time.perf_counter() - start
        return result

    #: The attack is built on what a defense does (its likelihood, its layers, its noise).
    uses_defense: ClassVar[bool] = False
    #: The attack reads what its defense adds to the model (a bottleneck's draw, Bayesian layers' noise), so it
    #: cannot run on the undefended update and takes no part in calibrating the verdicts there.
    needs_defense: ClassVar[bool] = False
    #: The attack solves each layer's linear system (R-GAP and its kin): an audit that runs it shows the
    #: report's architecture analysis of those systems (``architecture: auto``).
    solves_linear_systems: ClassVar[bool] = False
    #: The attack is built from a defense's own ``log_likelihood`` (the Bayes adversary): ``leakaudit init`` runs
    #: it on every defense that declares one.
    uses_likelihood: ClassVar[bool] = False
    #: What the attack brings that gradient matching lacks, in a few words ("" for none): where the attacks an
    #: audit ran break not even the undefended update, the report names the registered attacks with one that
    #: the audit did not run, as the stronger class to try.
    brings: ClassVar[str] = ""
    #: The attack reads only updates that no noise, or very little, touched (an exact decomposition): where a
    #: defense adds more it returns the data's mean image at once, so its break of the undefended update does not
    #: calibrate that defense's "protects".
    noise_free_only: ClassVar[bool] = False
    #: The attack learns once from all the updates it is given together and reads each with what it learned
    #: (Learning to Invert's network): a cell's updates are never split between workers, so its work is done once
    #: and its result does not depend on how many workers a run has.
    learns_per_cell: ClassVar[bool] = False

    #: The parameters ``attacks: auto`` runs the attack with, by device type ("cpu", "cuda"; another type takes
    #: "cpu"'s): budgets that fit the device. Empty: auto leaves the attack out, for the reason ``auto_skip`` gives.
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Why ``attacks: auto`` leaves the attack out where it declares no ``auto_params`` (another attack does its
    #: work more strongly, say); ``leakaudit validate`` shows it.
    auto_skip: ClassVar[str] = "it declares no auto_params"

    @classmethod
    def auto_settings(cls, device_type: str) -> dict[str, Any] | None:
        """The parameters ``attacks: auto`` gives the attack on this device type; None where auto leaves it out."""
        if not cls.auto_params:
            return None
        return dict(cls.auto_params.get(device_type, cls.auto_params.get("cpu", {})))

    @property
    def knows_defense(self) -> bool:
        """Whether this configured attack uses what the defense does (adaptive); sets its default report role."""
        return self.uses_defense

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        """Why this configured attack cannot apply to this model, batch size and protocol; None when it can.

        Checked before any work starts, so an impossible audit fails at once.
        """
        return None

    def beyond_reach(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        """Why this configured attack, though it applies, is not expected to recover anything here (past the reach
        measured for it); None within it. ``attacks: auto`` leaves it out there; an audit that lists it runs it."""
        return None

    def unsupported_defense(self, defense: Defense) -> str | None:
        """Why the attack cannot run against this defense; None when it can. Checked before any work."""
        return None

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        raise NotImplementedError

    @classmethod
    def reconstruct_all(cls, problems: list[Problem[Self]], max_problems: int | None = None) -> list[Reconstruction]:
        """Every problem's reconstruction, in order; ``max_problems`` caps how many run together.

        The default solves them one at a time, so an attack written for one problem works as it is;
        vectorised attacks override this to optimise many problems in one batched pass.
        """
        return [p.attack(p.observed, p.threat, p.generator) for p in problems]


def solve(problems: list[Problem[Any]], max_problems: int | None = None) -> list[Reconstruction]:
    """The reconstructions of ``problems`` (all of one attack), run as the engine runs every attack: under the
    math kernel of ``scaled_dot_product_attention``, since the fused kernels (flash, memory-efficient; nanoGPT's
    and GPT-2's attention) have no double backward, and gradient matching differentiates the update itself."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return type(problems[0].attack).reconstruct_all(problems, max_problems)
