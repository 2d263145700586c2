"""The ``Defense`` contract: how a defended update is shared and how likely it is under a candidate."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any, ClassVar, Iterator, Sequence, cast

import torch
from torch import Tensor, nn

from leakaudit.plugins.protocol import (
    CONTRIBUTORS,
    RUNNING_BUFFERS,
    ClientStep,
    LossFn,
    Protocol,
    TrainingRun,
    buffers_kept,
    load_running_buffers,
    parameter_names,
    running_buffers,
    trainable,
)
from leakaudit.plugins.spec import Param, resolve_params
from leakaudit.plugins.stochastic import noise_from


@dataclass
class SharedUpdate:
    """Exactly what leaves the client: one tensor per trainable parameter, plus public metadata."""

    tensors: list[Tensor]
    names: list[str]
    batch_size: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def flat(self) -> Tensor:
        return torch.cat([t.reshape(-1) for t in self.tensors])

    def to(self, device: torch.device | str) -> SharedUpdate:
        """The same update with its tensors on ``device`` (where an attack computes)."""
        return replace(self, tensors=[t.to(device) for t in self.tensors])


@dataclass(frozen=True)
class PrivacyProfile:
    """A defense's differential-privacy guarantee for one shared update that contains the target image, against
    an attacker who knows everything else: the update is ``mu``-Gaussian DP (Dong et al. 2022), and/or
    (epsilon, delta)-DP for each of ``pairs``, relative to a release that does not depend on the target (the
    update without it, or the noise alone). ``mechanism`` says how it follows, for the report."""

    mu: float | None = None
    pairs: tuple[tuple[float, float], ...] = ()
    mechanism: str = ""

    def __post_init__(self) -> None:
        if self.mu is None and not self.pairs:
            raise ValueError("PrivacyProfile: give mu or (epsilon, delta) pairs")
        if self.mu is not None and not self.mu >= 0:
            raise ValueError(f"PrivacyProfile: mu is {self.mu!r}; expected a number >= 0")
        if any(not (e >= 0 and 0 <= d <= 1) for e, d in self.pairs):
            raise ValueError(f"PrivacyProfile: pairs {self.pairs!r}; expected (epsilon >= 0, delta in [0, 1])")

    def reconstruction_bound(self, kappa: float) -> float:
        """The most any reconstruction attack can succeed where a guess made without the update succeeds with
        probability ``kappa`` (reconstruction robustness, Balle et al. 2022): ``Phi(Phi^-1(kappa) + mu)`` for
        mu-GDP (Kaissis et al. 2023; Hayes et al. 2023), ``e^epsilon kappa + delta`` for (epsilon, delta)-DP."""
        if not 0 < kappa < 1:
            return 1.0 if kappa >= 1 else 0.0
        bounds = [min(1.0, math.exp(e) * kappa + d) if e < 700 else 1.0 for e, d in self.pairs]
        if self.mu is not None:
            normal = NormalDist()
            bounds.append(1.0 if math.isinf(self.mu) else normal.cdf(normal.inv_cdf(kappa) + self.mu))
        return min(bounds)

    def epsilon(self, delta: float, releases: int = 1) -> float:
        """The least epsilon at ``delta`` of ``releases`` such updates composed: mu-GDP composes to
        ``sqrt(releases) mu``-GDP, whose (epsilon, delta) curve is delta(epsilon) = Phi(-epsilon/mu + mu/2) -
        e^epsilon Phi(-epsilon/mu - mu/2) (Dong et al. 2022, Cor. 2.13), solved by bisection in log space so that
        a mu of thousands gives its epsilon of millions; from ``pairs`` alone, the composition of the best pair
        (Dwork & Roth 2014, Thm. 3.16). inf where the profile allows no such delta."""
        if not 0 < delta < 1 or releases < 1:
            raise ValueError(f"PrivacyProfile.epsilon: delta {delta!r} (in (0, 1)) and releases {releases!r} (>= 1)")
        best = min((releases * e for e, d in self.pairs if releases * d <= delta), default=math.inf)
        if self.mu is None:
            return best
        mu = math.sqrt(releases) * self.mu
        if math.isinf(mu):
            return best
        if mu == 0:
            return 0.0
        from scipy.special import log_ndtr, ndtr

        def excess(eps: float) -> float:  # delta(eps) - delta, decreasing in eps
            return float(ndtr(-eps / mu + mu / 2) - math.exp(eps + log_ndtr(-eps / mu - mu / 2))) - delta

        if excess(0.0) <= 0:
            return 0.0
        low, high = 0.0, max(1.0, mu * mu)
        while excess(high) > 0:
            low, high = high, 2 * high
        for _ in range(200):
            mid = (low + high) / 2
            if excess(mid) > 0:
                low = mid
            else:
                high = mid
            if high - low <= 1e-12 * high:
                break
        return min(best, high)


#: The metadata key of the coordinates the audited client (the first of an update's clients) alone sent, per tensor,
#: where secure aggregation reveals each coordinate's contributors: the aggregate there is that client's own value.
#: The audit grants the server their attribution to that client, the worst case for the defense (counts alone
#: tell the server which coordinates one client sent, not which client).
ALONE = "alone"

#: The kinds of update a client may share: a defense that changes which tensors are shared declares its kind
#: (``Defense.shares``), an attack the kinds it reads (``Attack.reads``), and a defense's "protects" is calibrated
#: only by an attack that reads its kind (docs/verdicts.md).
FULL, NO_EMBEDDING, ADAPTERS = "full", "no embedding", "adapters"
UPDATE_KINDS = {
    FULL: "every trained weight's gradient (or its change)",
    NO_EMBEDDING: "every gradient but the token embedding's (frozen embeddings)",
    ADAPTERS: "the low-rank adapters' gradients and the head's, no base weight's (LoRA)",
}


class Defense:
    """Base class: subclasses set ``name``, ``params`` and override what their defense changes.

    Gradient-space defenses override ``perturb`` (and ``log_likelihood``);
    architectural ones override ``wrap_model`` (and ``client_loss`` when they train with
    an extra term). A defense that needs the model and inputs, not just the update,
    overrides ``share`` and cannot be a chain member. ``params`` declares the YAML
    parameters, checked before any work starts; resolved values are attributes.
    """

    name: ClassVar[str]
    params: ClassVar[dict[str, Param]] = {}
    #: The examples the defense applies to (``leakaudit.plugins.text.MODALITIES``): a defense of the update alone
    #: applies to any; one that reads pixels or an image model's layers says ("image",).
    modalities: ClassVar[tuple[str, ...]] = ("image", "text")
    deterministic: ClassVar[bool] = False
    #: ``log_likelihood`` is finite only near what was sent (a quantiser's kernel): ``check_defense`` then takes its
    #: slopes and curvature at the true candidate by autograd, since finite differences would step out of it.
    bounded_support: ClassVar[bool] = False
    #: The undefended reference: the report draws it as the point every defense is compared with.
    baseline: ClassVar[bool] = False
    #: The defense is what Opacus's DPOptimizer does to an update (per-example clipping, Gaussian noise), with
    #: the optimizer's ``noise_multiplier`` and ``max_grad_norm`` as parameters: a LeakMonitor on a training
    #: under a DPOptimizer audits it as this defense.
    mirrors_dp_optimizer: ClassVar[bool] = False
    #: The paper the defense comes from (author, year), shown by ``leakaudit plugins``.
    paper: ClassVar[str] = ""
    #: The kind of update the defense leaves shared, one of ``UPDATE_KINDS``: only an attack that reads it
    #: (``Attack.reads``) calibrates the defense's "protects".
    shares: ClassVar[str] = FULL
    #: Each client sends most coordinates as zeros, which ones depending on its data (top-k, a percentile cut):
    #: under secure aggregation every client sparsifies its own update before the server aggregates them
    #: (``Protocol.aggregate``), so a coordinate one client alone sent can show its value (Suimon et al. 2025).
    sparsifies: ClassVar[bool] = False

    def __init__(self, **settings: Any) -> None:
        self.settings = resolve_params(self.params, settings, self.name)
        for key, value in self.settings.items():
            setattr(self, key, value)
        self.model_changes: list[str] = []  # what ``wrap_model`` changed, one line each, for the report

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return f"{type(self).__name__}({args})"

    def unsupported(self, protocol: Protocol) -> str | None:
        """Why the defense cannot run under ``protocol``; None when it can. Checked before any work."""
        return None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Change the architecture before training (identity for gradient-space defenses).

        Record each change in ``self.model_changes``; the report lists them.
        """
        return model

    def client_loss(self, model: nn.Module, loss_fn: LossFn) -> LossFn:
        """The loss the client differentiates: the task loss, plus any term the defense trains with (a KL)."""
        return loss_fn

    def parameter_term(self, model: nn.Module) -> Tensor | None:
        """The term ``client_loss`` adds to the task loss where it depends on the parameters alone (Bayesian layers'
        KL), computed from the model's own parameters; None where it adds none, or one that depends on the data.

        Under FedSGD its gradient is the same for every candidate image, so attackers add it once
        (``parameter_gradient``) instead of differentiating it twice in every iteration. Where it is not None,
        ``client_loss(model, loss_fn)`` must be exactly ``loss_fn`` plus it."""
        return None

    def defended_tensors(self, names: Sequence[str]) -> set[str]:
        """Names of shared tensors the defense rewrote so that an informed attacker leaves them out of a match."""
        return set()

    def augment(self, pixels: Tensor, generator: torch.Generator) -> Tensor:
        """The images the client really computes its update on, in pixel space [0, 1]: the private images
        themselves, or their augmentations for a defense that trains on augmented images (ATS). Attacks
        reconstruct, and are scored against, these. Draws all randomness from ``generator``."""
        return pixels

    @classmethod
    def augments(cls) -> bool:
        """Whether the defense changes the images the client trains on (overrides ``augment``)."""
        return cls.augment is not Defense.augment

    @classmethod
    def shares_itself(cls) -> bool:
        """Whether the defense computes the update from the model and inputs (overrides ``share``)."""
        return cls.share is not Defense.share

    def train(self, model: nn.Module, run: TrainingRun) -> Iterator[nn.Module]:
        """Train ``model`` in place for ``run.steps`` steps under the defense (the utility side).

        Yields the model before every step and once after the last, so the caller can
        checkpoint and score it. The default draws fixed-size batches with replacement (through
        ``augment`` when the defense augments) and applies each step's shared update with SGD;
        override to train another way (Opacus).
        """
        optimiser = torch.optim.SGD(trainable(model), lr=run.lr, momentum=run.momentum)
        model.train()
        for _ in range(run.steps):
            yield model
            x, y = run.batch()
            update = self.share(ClientStep(model, run.loss_fn, x, y, run.noise_generator, run.protocol))
            for p, g in zip(trainable(model), update.tensors):
                p.grad = g
            optimiser.step()
            if RUNNING_BUFFERS in update.metadata:  # the server takes the client's BatchNorm statistics with its weights
                load_running_buffers(model, update.metadata[RUNNING_BUFFERS])
        yield model

    def share(self, step: ClientStep) -> SharedUpdate:
        """The defended update the client sends for this step (stochastic layers draw from its generator)."""
        step = replace(step, loss_fn=self.client_loss(step.model, step.loss_fn))
        with noise_from(step.model, step.generator), buffers_kept(step.model):
            each = (step.protocol.client_updates(step.model, step.loss_fn, step.inputs, step.labels, step.generator)
                    if self.sparsifies else [step.clean_update()])
            # sent as they are (noise defenses perturb the weights' update only); one client's alone: per-client
            # sparsified updates aggregated carry no one client's buffers
            buffers = {} if self.sparsifies else running_buffers(step.model)
        applied = [self.apply(clean, step.generator) for clean in each]
        sent, public = applied[0] if len(applied) == 1 else aggregated([s for s, _ in applied], step.protocol)
        meta = {"protocol": step.protocol.name, **public, **({RUNNING_BUFFERS: buffers} if buffers else {})}
        return SharedUpdate(sent, parameter_names(step.model), len(step.inputs), meta)

    def apply(self, update: list[Tensor], generator: torch.Generator) -> tuple[list[Tensor], dict[str, Any]]:
        """The sent tensors and the metadata the server learns with them (override to publish metadata)."""
        return self.perturb(update, generator), {}

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        """Map the clean update to the sent one, drawing all randomness from ``generator``."""
        return update

    def candidate_update(self, threat: Any, images: Tensor, labels: Tensor) -> list[Tensor]:
        """The clean update ``log_likelihood`` is centred on, for normalised candidate ``images``.

        The plain update by default; a defense that transforms each example's gradient
        (DP-SGD's clipping) returns its own, differentiably in ``images``.
        """
        return threat.candidate_update(images, labels)

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """``log p(observed | candidate)`` up to a constant, differentiable in ``candidate``.

        ``candidate`` is the clean update that a candidate input would produce.
        """
        raise NotImplementedError(f"defense {self.name!r} declares no log_likelihood")

    def privacy_spent(self, steps: int, sample_rate: float, delta: float) -> float | None:
        """Epsilon at ``delta`` after ``steps`` where the defense has a formal guarantee, else None."""
        return None

    def stated_over(self, rounds: int) -> Defense:
        """This defense with its guarantee stated over ``rounds`` releases of the update (the rounds a federated
        client really took part in), where it declares a ``rounds`` parameter (its mechanism text and epsilon are
        then composed over them); itself where it declares none."""
        if "rounds" not in self.params or self.settings.get("rounds") == rounds:
            return self
        return type(self)(**{**self.settings, "rounds": rounds})

    def under(self, protocol: Protocol) -> Defense:
        """This defense as it runs under ``protocol``, where its likelihood or guarantee depends on the protocol's
        settings (DP-SGD's local steps under FedAvg); itself where neither does. The engine builds every defense of
        a setting through it, so that ``log_likelihood`` and ``privacy_profile`` read the protocol."""
        return self

    def privacy_profile(self, radius: float | None = None) -> PrivacyProfile | None:
        """The guarantee of one shared update that contains the target, where the defense gives one (None: it
        gives none). ``radius`` bounds the L2 norm of the update the defense receives (a ``clip`` before it in a
        chain); None where nothing bounds it. The report holds every attack's identification rate to the bound
        it implies, and ``check_defense`` checks it against what ``share`` sends."""
        return None

    @classmethod
    def mirrored_settings(cls, mechanism: Any) -> dict[str, Any] | None:
        """This defense's settings where ``mechanism``, a framework's own privacy object (a Flower ``LocalDpMod``),
        is what the defense computes; None where it mirrors no such object. A monitor that finds the object where
        training runs audits it as this defense (``LeakAuditMod(mods=[...])``)."""
        return None

    @classmethod
    def declares_likelihood(cls) -> bool:
        """Whether the class overrides ``log_likelihood`` (precode and bayesian draw noise inside the model: no)."""
        return cls.log_likelihood is not Defense.log_likelihood

    def has_likelihood(self) -> bool:
        """Whether this configured defense has a likelihood (a chain: its last member's)."""
        return self.declares_likelihood()


class DeterministicDefense(Defense):
    """A defense that maps the update through a fixed function ``transform`` (no randomness).

    Its likelihood is the zero-noise limit, ``-||g - transform(g(x))||^2 / 2``, whose
    maximisers are exactly the inputs consistent with the observation. As a chain
    member before a random defense, ``transform`` is applied to the candidate.
    """

    deterministic: ClassVar[bool] = True

    def transform(self, update: Sequence[Tensor]) -> list[Tensor]:
        return list(update)

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        return self.transform(update)

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        return -0.5 * squared_distance(observed.tensors, self.transform(candidate))

    def output_radius(self, radius: float | None) -> float | None:
        """A bound on the L2 norm of what ``transform`` returns, given ``radius`` on what it receives (None: no
        bound is known). A noise member after it in a chain turns the bound into a privacy guarantee."""
        return None




def aggregated(sent: list[list[Tensor]], protocol: Protocol) -> tuple[list[Tensor], dict[str, Any]]:
    """The server's aggregate of the clients' sparsified ``sent`` updates and what it learns with it; where that is
    each coordinate's count of contributors, also the coordinates the first client alone sent (``ALONE``)."""
    tensors, public = protocol.aggregate(sent)
    if CONTRIBUTORS in public:
        public[ALONE] = [(n == 1) & (mine != 0) for n, mine in zip(public[CONTRIBUTORS], sent[0])]
    return tensors, public


class OwnCoordinates(DeterministicDefense):
    """What the server reads on the coordinates it knows to be one client's own (metadata ``ALONE``): that client's
    values exactly there, nothing elsewhere; its likelihood matches those coordinates only."""

    name = "own coordinates"

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        return -0.5 * _total([((o - c) ** 2 * m).sum()
                              for o, c, m in zip(observed.tensors, candidate, observed.metadata[ALONE])])


def _total(parts: list[Tensor]) -> Tensor:
    """The sum of per-tensor scalars in two kernels (a stack, a sum) instead of one addition per tensor."""
    return torch.stack(parts).sum() if parts else torch.zeros(())  # an update with every tensor dropped: 0


def squared_distance(observed: Sequence[Tensor], candidate: Sequence[Tensor]) -> Tensor:
    """Sum over all tensors of the squared Euclidean distance."""
    return _total([(o - c).square().sum() for o, c in zip(observed, candidate)])


def cosine_distance(observed: Sequence[Tensor], candidate: Sequence[Tensor]) -> Tensor:
    """1 - cosine similarity of the whole updates, all layers jointly (Geiping et al. 2020, Eq. 4). Summed tensor by
    tensor: one flattened copy of each update would save kernels, but its double backward writes a zero-filled
    copy of the whole update per tensor (``slice_backward``), 26% slower at 64 vmapped targets on a CPU."""
    dot = _total([(o * c).sum() for o, c in zip(observed, candidate)])
    norm_o = _total([o.square().sum() for o in observed]).sqrt()
    norm_c = _total([c.square().sum() for c in candidate]).sqrt()
    return 1 - dot / (norm_o * norm_c).clamp_min(1e-12)


def per_tensor_cosine_distance(observed: Sequence[Tensor], candidate: Sequence[Tensor]) -> Tensor:
    """Sum over tensors of each tensor's own 1 - cosine similarity (Chen & Campbell 2022's hybrid)."""
    return cast(Tensor, sum(cosine_distance([o], [c]) for o, c in zip(observed, candidate)))
