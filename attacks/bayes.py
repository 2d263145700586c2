"""The Bayes-optimal adversary (Balunovic et al. 2022) and its distance-based relatives l2, l1, cos.

All four maximise ``(1/k) sum_i [w log p(g | x_i) - beta R(x_i)]`` over images ``x``,
with ``x_i`` drawn uniformly from the delta-ball around ``x`` (k = 1 at the centre by
default), Adam with an exponentially decaying step and the box constraint. They
differ only in ``log p(g | x)``: ``bayes`` asks the audited defense for its own
likelihood; ``l2``, ``l1`` and ``cos`` assume a Gaussian, a Laplacian and a
direction-only observation, whatever the defense really does (Balunovic et al. 2022, Table 1).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from leakaudit.plugins.attack import Attack, Reconstruction, ThreatModel
from leakaudit.attacks.gradient_matching import LABEL_METHOD, PRIOR_WEIGHTS, cosine_distance, random_images
from leakaudit.attacks.labels import recover_labels
from leakaudit.attacks.priors import check_priors, prior_penalty
from leakaudit.plugins.defense import SharedUpdate, squared_distance
from leakaudit.plugins import Param, hookimpl


def sample_in_ball(centre: Tensor, radius: float, samples: int, generator: torch.Generator) -> Tensor:
    """``samples`` points uniform in the L2 ball of ``radius`` around each image of ``centre``, (k, B, ...)."""
    if radius == 0:
        return centre.unsqueeze(0)
    shape = (samples, *centre.shape)
    direction = torch.randn(shape, generator=generator, device=centre.device)
    flat = direction.flatten(2)
    direction = (flat / flat.norm(dim=2, keepdim=True)).view(shape)
    d = centre[0].numel()
    r = radius * torch.rand((samples, centre.shape[0]), generator=generator, device=centre.device) ** (1.0 / d)
    return centre.unsqueeze(0) + r.view(samples, -1, *([1] * (centre.dim() - 1))) * direction


class LikelihoodAttack(Attack):
    """Shared optimiser of the likelihood-based attacks; subclasses define ``negative_log_likelihood``."""

    params = {
        "iterations": Param(2000, int, min=1, help="Adam steps"),
        "lr": Param(0.1, float, min=0.0, exclusive_min=True, help="initial Adam step size"),
        "lr_decay": Param(0.1, float, min=0.0, max=1.0, exclusive_min=True,
                          help="final step size as a fraction of the first (exponential decay)"),
        "priors": Param({"tv": 1e-4}, dict, help=PRIOR_WEIGHTS + "; their sum is beta * R(x)"),
        "samples": Param(1, int, min=1, help="Monte Carlo samples k in the delta-ball"),
        "radius": Param(0.0, float, min=0.0, help="delta: radius of the ball, in normalised input space"),
        "warmup": Param(0, int, min=0, help="steps over which the likelihood weight grows from 0.001 to 1"),
        "label_method": LABEL_METHOD,
    }

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        check_priors(self.priors)

    def negative_log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor],
                                threat: ThreatModel) -> Tensor:
        raise NotImplementedError

    def candidate(self, threat: ThreatModel, images: Tensor, labels: Tensor) -> list[Tensor]:
        """The candidate's clean update, as the distance sees it (the plain one)."""
        return threat.candidate_update(images, labels)

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        labels = recover_labels(observed, threat, self.label_method, generator)
        observed = SharedUpdate([t.to(threat.device) for t in observed.tensors], observed.names,
                                observed.batch_size, observed.metadata)
        lo, hi = threat.box()
        images = random_images(threat, generator).requires_grad_(True)
        optimiser = torch.optim.Adam([images], lr=self.lr)
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimiser, gamma=self.lr_decay ** (1.0 / self.iterations))
        trace = torch.empty(self.iterations, device=threat.device)
        for it in range(self.iterations):
            weight = min(1.0, 1e-3 * 1e3 ** (it / self.warmup)) if self.warmup else 1.0
            loss = self._objective(images, labels, observed, threat, weight, generator, lo, hi)
            (images.grad,) = torch.autograd.grad(loss, images)
            optimiser.step()
            schedule.step()
            with torch.no_grad():
                images.copy_(torch.maximum(torch.minimum(images, hi), lo))
            trace[it] = loss.detach()
        return Reconstruction(threat.to_pixels(images.detach()), labels, trace.tolist(), 0.0)

    def _objective(self, images, labels, observed, threat, weight, generator, lo, hi) -> Tensor:
        total = 0.0
        points = sample_in_ball(images, self.radius, self.samples, generator)
        for x in points:
            candidate = self.candidate(threat, x, labels)
            total = total + weight * self.negative_log_likelihood(observed, candidate, threat)
            total = total + prior_penalty(x, self.priors, lo, hi)
        return total / len(points)


class BayesOptimal(LikelihoodAttack):
    """The approximate Bayes-optimal adversary: the audited defense's own log p(g|x) plus a weighted prior."""

    name = "bayes"
    paper = "Balunovic et al. 2022"
    uses_defense = True

    def unsupported_defense(self, defense) -> str | None:
        if defense.has_likelihood():
            return None
        return (f"bayes: defense {defense.name!r} declares no log_likelihood (its noise is drawn inside the "
                "model); use the attacks made for it (leakaudit plugins)")

    def candidate(self, threat, images, labels) -> list[Tensor]:
        return threat.defense.candidate_update(threat, images, labels)

    def negative_log_likelihood(self, observed, candidate, threat) -> Tensor:
        return -threat.defense.log_likelihood(observed, candidate)


class L2Matching(LikelihoodAttack):
    """Squared Euclidean gradient distance (the Bayes adversary of Gaussian noise), same optimiser as bayes."""

    name = "l2"
    paper = "Balunovic et al. 2022"

    def negative_log_likelihood(self, observed, candidate, threat) -> Tensor:
        return squared_distance(observed.tensors, candidate)


class L1Matching(LikelihoodAttack):
    """L1 gradient distance (the Bayes adversary of Laplacian noise), same optimiser as bayes."""

    name = "l1"
    paper = "Balunovic et al. 2022"

    def negative_log_likelihood(self, observed, candidate, threat) -> Tensor:
        return sum((o - c).abs().sum() for o, c in zip(observed.tensors, candidate))


class CosineMatching(LikelihoodAttack):
    """Cosine gradient distance (direction only), same optimiser as bayes."""

    name = "cos"
    paper = "Balunovic et al. 2022"

    def negative_log_likelihood(self, observed, candidate, threat) -> Tensor:
        return cosine_distance(observed.tensors, candidate)


@hookimpl
def register_attacks():
    return [BayesOptimal, L2Matching, L1Matching, CosineMatching]
