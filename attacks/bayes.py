"""The Bayes-optimal adversary (Balunovic et al. 2022) and its distance-based relatives l2, l1, cos.

All four maximise ``(1/k) sum_i [w log p(g | x_i) - beta R(x_i)]`` over images ``x``,
with ``x_i`` drawn uniformly from the delta-ball around ``x`` (k = 1 at the centre by
default), Adam with an exponentially decaying step and the box constraint. They
differ only in ``log p(g | x)``: ``bayes`` asks the audited defense for its own
likelihood; ``l2``, ``l1`` and ``cos`` assume a Gaussian, a Laplacian and a
direction-only observation, whatever the defense really does (Balunovic et al. 2022, Table 1).
"""
from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import Tensor
from typing_extensions import Self

from leakaudit.attacks.gradient_matching import LABEL_METHOD, PRIOR_WEIGHTS, random_images
from leakaudit.attacks.labels import recover_labels
from leakaudit.attacks.priors import check_priors, prior_penalty
from leakaudit.attacks.vectorised import (
    Batch,
    SharedModel,
    candidate_update,
    defense_candidate,
    Plain,
    one_at_a_time,
    refuse_one_path_overrides,
    optimise,
    prior_sum,
    problem_hyper,
    solve_all,
    split_metadata,
    stack_targets,
    vectorisable,
)
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.attack import MAX_ITERATIONS, Attack, Problem, Reconstruction, ThreatModel, HONEST_SERVER
from leakaudit.plugins.defense import SharedUpdate, cosine_distance


def ball_draws(centre: Tensor, samples: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The random draws of ``sample_in_ball``: directions (k, B, ...) and uniform radii fractions (k, B)."""
    direction = torch.randn((samples, *centre.shape), generator=generator, device=centre.device)
    return direction, torch.rand((samples, centre.shape[0]), generator=generator, device=centre.device)


def ball_points(centre: Tensor, radius: float, direction: Tensor, u: Tensor) -> Tensor:
    """Points at uniform positions in the L2 ball of ``radius`` around each image, from ``ball_draws``."""
    flat = direction.flatten(2)
    direction = (flat / flat.norm(dim=2, keepdim=True)).view(direction.shape)
    r = radius * u ** (1.0 / centre[0].numel())
    return centre.unsqueeze(0) + r.view(u.shape[0], -1, *([1] * (centre.dim() - 1))) * direction


def sample_in_ball(centre: Tensor, radius: float, samples: int, generator: torch.Generator) -> Tensor:
    """``samples`` points uniform in the L2 ball of ``radius`` around each image of ``centre``, (k, B, ...)."""
    if radius == 0:
        return centre.unsqueeze(0)
    return ball_points(centre, radius, *ball_draws(centre, samples, generator))


class LikelihoodAttack(Attack):
    """Shared optimiser of the likelihood-based attacks; subclasses define ``negative_log_likelihood``."""
    attacker = HONEST_SERVER

    params = {
        "iterations": Param(2000, int, min=1, max=MAX_ITERATIONS, help="Adam steps", budget=True),
        "lr": Param(0.1, float, min=0.0, exclusive_min=True, help="initial Adam step size"),
        "lr_decay": Param(0.1, float, min=0.0, max=1.0, exclusive_min=True,
                          help="final step size as a fraction of the first (exponential decay)"),
        "priors": Param({"tv": 1e-4}, dict, help=PRIOR_WEIGHTS + "; their sum is beta * R(x)"),
        "samples": Param(1, int, min=1, help="Monte Carlo samples k in the delta-ball"),
        "radius": Param(0.0, float, min=0.0, help="delta: radius of the ball, in normalised input space"),
        "warmup": Param(0, int, min=0, help="steps over which the likelihood weight grows from 0.001 to 1"),
        "signed": Param(False, bool, help="Adam on the sign of the image gradient (Geiping et al. 2020): steps "
                                          "that a likelihood's steep or flat stretches do not scale"),
        "label_method": LABEL_METHOD,
    }
    iterations: int
    lr: float
    lr_decay: float
    priors: dict[str, Any]
    samples: int
    radius: float
    warmup: int
    signed: bool
    label_method: str

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        check_priors(self.priors)

    def negative_log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor],
                                threat: ThreatModel) -> Tensor:
        raise NotImplementedError

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_one_path_overrides(cls, ("reconstruct", "_objective"))

    #: The settings that may differ between problems solved in one pass (each row's step size, decay and prior
    #: weights); any other setting a subclass adds separates its problems (``like_problems``).
    per_problem: ClassVar[frozenset[str]] = frozenset({"lr", "lr_decay", "priors"})

    @classmethod
    def reconstruct_all(cls, problems: list[Problem[Self]], max_problems: int | None = None) -> list[Reconstruction]:
        """Problems with like settings optimised together, ``max_problems`` at a time (Monte Carlo draws and
        starts from each problem's own generator); both paths minimise ``objective``."""
        return solve_all(cls, problems, max_problems, per_problem=cls.per_problem, can_vectorise=vectorisable,
                         build=cls._batch, model=id, images=lambda p: p.attack.samples)

    @classmethod
    def _batch(cls, problems: list[Problem[Self]]) -> tuple[Batch | None, Any]:
        threat = problems[0].threat
        updates = [p.observed for p in problems]
        split = split_metadata(updates)
        if split is None:  # metadata that differs in more than tensors: one problem at a time
            return None, lambda _: one_at_a_time(cls, problems)
        labels, starts = [], []
        for p in problems:  # as alone: labels, then the start; Monte Carlo draws follow, step by step
            labels.append(recover_labels(p.observed, p.threat, p.attack.label_method, p.generator))
            starts.append(random_images(p.threat, p.generator))
        device = threat.device
        hyper = {**problem_hyper([p.attack for p in problems], device),
                 "gamma": torch.tensor([p.attack.lr_decay ** (1.0 / p.attack.iterations) for p in problems],
                                       device=device, dtype=torch.float64)}
        batch = Batch(problems, torch.stack(starts), torch.stack(labels), stack_targets(updates, device), *split,
                      hyper, list(range(len(problems))))
        return batch, lambda b: cls._solve(b, labels)

    @classmethod
    def _solve(cls, batch: Batch, labels: list[Tensor]) -> list[Reconstruction]:
        first, threat, template = batch.problems[0].attack, batch.problems[0].threat, batch.problems[0].observed
        shared = SharedModel.of(threat.model, threat)
        lo, hi = threat.box()

        def objective(images, labels, target, metadata, hyper, unknowns, weight, direction=None, u=None):
            points = images.unsqueeze(0) if direction is None else ball_points(images, first.radius, direction, u)
            return first.objective(points, labels, batch.observed(target, metadata, template), threat, weight,
                                   lambda x, y: candidate_update(shared, threat, x, y), lambda x: prior_sum(x, hyper, lo, hi))

        # the likelihood's weight at every iteration, made once on the device: a compiled step takes it as an input
        weights = torch.tensor([min(1.0, 1e-3 * 1e3 ** (it / first.warmup)) if first.warmup else 1.0
                                for it in range(first.iterations)], device=batch.starts.device,
                               dtype=batch.starts.dtype)

        def per_step(it: int) -> tuple:
            weight = weights[it]
            if first.radius == 0:
                return ((weight, None),)
            draws = [ball_draws(s, first.samples, p.generator) for s, p in zip(batch.starts, batch.problems)]
            return (weight, None), (torch.stack([d for d, _ in draws]), 0), (torch.stack([u for _, u in draws]), 0)

        gamma = batch.hyper.pop("gamma")
        images, _, trace = optimise(batch, objective, iterations=first.iterations, signed=first.signed, box=(lo, hi),
                                 lr_factor=lambda it: (gamma ** it).to(batch.hyper["lr"].dtype), per_step=per_step)
        return [Reconstruction(p.threat.to_pixels(images[i].detach()), labels[i], trace[:, i].tolist(), 0.0)
                for i, p in enumerate(batch.problems)]

    def candidate(self, threat: ThreatModel, images: Tensor, labels: Tensor, plain: Plain) -> list[Tensor]:
        """The candidate's clean update as the likelihood sees it: ``plain``'s (the model's update on this path)."""
        return plain(images, labels)

    def objective(self, points: Tensor, labels: Tensor, observed: SharedUpdate, threat: ThreatModel,
                  weight: Tensor | float, plain: Plain, prior: Callable[[Tensor], Tensor | float]) -> Tensor:
        """The loss both paths minimise: the mean over the ball's ``points`` of ``weight`` times the negative log
        likelihood of their candidate updates, plus ``prior`` of each (one problem's; vmapped on the batched path)."""
        total = points.new_zeros(())
        for x in points:
            total = total + weight * self.negative_log_likelihood(observed, self.candidate(threat, x, labels, plain),
                                                                  threat)
            total = total + prior(x)
        return total / len(points)

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        labels = recover_labels(observed, threat, self.label_method, generator)
        observed = observed.to(threat.device)
        lo, hi = threat.box()
        images = random_images(threat, generator).requires_grad_(True)
        optimiser = torch.optim.Adam([images], lr=self.lr)
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimiser, gamma=self.lr_decay ** (1.0 / self.iterations))
        trace = torch.empty(self.iterations, device=threat.device)
        for it in range(self.iterations):
            weight = min(1.0, 1e-3 * 1e3 ** (it / self.warmup)) if self.warmup else 1.0
            loss = self._objective(images, labels, observed, threat, weight, generator, lo, hi)
            (grad,) = torch.autograd.grad(loss, images)
            images.grad = grad.sign() if self.signed else grad
            optimiser.step()
            schedule.step()
            with torch.no_grad():
                images.copy_(torch.maximum(torch.minimum(images, hi), lo))
            trace[it] = loss.detach()
        return Reconstruction(threat.to_pixels(images.detach()), labels, trace.tolist(), 0.0)

    def _objective(self, images, labels, observed, threat, weight, generator, lo, hi) -> Tensor:
        """``objective`` of one problem by plain autograd, at this step's points of the ball."""
        return self.objective(sample_in_ball(images, self.radius, self.samples, generator), labels, observed, threat,
                              weight, threat.candidate_update, lambda x: prior_penalty(x, self.priors, lo, hi))


class BayesOptimal(LikelihoodAttack):
    """The approximate Bayes-optimal adversary: the audited defense's own log p(g|x) plus a weighted prior."""

    name = "bayes"
    paper = "Balunovic et al. 2022"
    auto_params = {"cpu": {"iterations": 1000}, "cuda": {"iterations": 2000}}
    uses_defense = True
    uses_likelihood = True
    brings = "the defense's own likelihood p(g|x), the adversary that knows it"

    def unsupported_defense(self, defense) -> str | None:
        if defense.has_likelihood():
            return None
        return (f"bayes: defense {defense.name!r} declares no log_likelihood (its noise is drawn inside the "
                "model); use the attacks made for it (leakaudit plugins)")

    def candidate(self, threat, images, labels, plain) -> list[Tensor]:
        """The defense's own candidate where it centres its likelihood on one (DP-SGD's clipped mean)."""
        return (threat.defense.candidate_update(threat, images, labels) if defense_candidate(threat.defense)
                else plain(images, labels))

    def negative_log_likelihood(self, observed, candidate, threat) -> Tensor:
        return -threat.defense.log_likelihood(observed, candidate)


LAYER_WEIGHTS = ("equal", "exp")


def layer_weights(kind: str, tensors: int) -> list[float]:
    """Each shared tensor's weight in a distance: 1 for ``equal``; ``exp`` gives tensor i the weight e^-i, the
    layers nearest the input counting most (Geiping et al. 2020's exponential weighting, searched over by
    Balunovic et al. 2022, A.3)."""
    return [1.0] * tensors if kind == "equal" else [math.exp(-i) for i in range(tensors)]


class DistanceMatching(LikelihoodAttack):
    """A fixed gradient distance in place of the defense's likelihood, optionally weighted per layer."""

    params = {**LikelihoodAttack.params,
              "layer_weights": Param("equal", str, choices=LAYER_WEIGHTS,
                                     help="equal, or exp: tensor i of the update weighted e^-i (Geiping et al. 2020)")}
    layer_weights: str

    def weights(self, observed: SharedUpdate) -> list[float]:
        return layer_weights(self.layer_weights, len(observed.tensors))


class L2Matching(DistanceMatching):
    """Squared Euclidean gradient distance (the Bayes adversary of Gaussian noise), same optimiser as bayes."""

    name = "l2"
    paper = "Balunovic et al. 2022"
    auto_skip = "bayes runs the matching adversary: l2 is its form for Gaussian noise"

    def negative_log_likelihood(self, observed, candidate, threat) -> Tensor:
        return sum(w * ((o - c) ** 2).sum() for w, o, c in zip(self.weights(observed), observed.tensors, candidate))


class L1Matching(DistanceMatching):
    """L1 gradient distance (the Bayes adversary of Laplacian noise), same optimiser as bayes."""

    name = "l1"
    paper = "Balunovic et al. 2022"
    auto_skip = "bayes runs the matching adversary: l1 is its form for Laplacian noise"

    def negative_log_likelihood(self, observed, candidate, threat) -> Tensor:
        return sum(w * (o - c).abs().sum() for w, o, c in zip(self.weights(observed), observed.tensors, candidate))


class CosineMatching(DistanceMatching):
    """Cosine gradient distance (direction only), same optimiser as bayes; with layer weights, each tensor's
    products and norms are weighted, as in Geiping et al.'s code."""

    name = "cos"
    paper = "Balunovic et al. 2022"
    auto_skip = "inverting_gradients runs the cosine match, with its image prior"

    def negative_log_likelihood(self, observed, candidate, threat) -> Tensor:
        if self.layer_weights == "equal":
            return cosine_distance(observed.tensors, candidate)
        w = self.weights(observed)
        dot = sum(wi * (o * c).sum() for wi, o, c in zip(w, observed.tensors, candidate))
        norm_o = sum(wi * (o * o).sum() for wi, o in zip(w, observed.tensors)).sqrt()
        norm_c = sum(wi * (c * c).sum() for wi, c in zip(w, candidate)).sqrt()
        return 1 - dot / (norm_o * norm_c).clamp_min(1e-12)


@hookimpl
def register_attacks():
    return [BayesOptimal, L2Matching, L1Matching, CosineMatching]
