"""Gradient-matching attacks: optimise images whose update matches the observed one."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from attacks.base import Attack, Reconstruction, ThreatModel
from attacks.labels import labels_from_signs
from attacks.priors import total_variation
from defenses.base import SharedUpdate
from plugins import Param, hookimpl


def cosine_distance(observed: Sequence[Tensor], candidate: Sequence[Tensor]) -> Tensor:
    """1 - cosine similarity of the whole updates, all layers jointly (seed 004, Eq. 4)."""
    dot = sum((o * c).sum() for o, c in zip(observed, candidate))
    norm_o = sum((o * o).sum() for o in observed).sqrt()
    norm_c = sum((c * c).sum() for c in candidate).sqrt()
    return 1 - dot / (norm_o * norm_c).clamp_min(1e-12)


def step_decay_milestones(iterations: int) -> list[int]:
    """Learning-rate drops at 3/8, 5/8 and 7/8 of the run, as in seed 004."""
    return [iterations * k // 8 for k in (3, 5, 7)]


def attack_labels(observed: SharedUpdate, threat: ThreatModel) -> Tensor:
    """Known labels where the threat model grants them, else recovered from the gradient."""
    if threat.labels is not None:
        return threat.labels.to(threat.device)
    return labels_from_signs(observed, threat.batch_size).to(threat.device)


class InvertingGradients(Attack):
    """Cosine gradient matching with total variation, signed Adam and a box constraint (Geiping et al.)."""

    name = "inverting_gradients"
    params = {
        "iterations": Param(4800, int, min=1, help="optimisation steps per restart"),
        "lr": Param(0.1, float, min=0.0, exclusive_min=True, help="Adam step size"),
        "tv": Param(1e-2, float, min=0.0, help="total-variation weight"),
        "restarts": Param(1, int, min=1, help="random restarts; the best gradient match is kept"),
        "signed": Param(True, bool, help="use the sign of the image gradient (adversarial-attack style)"),
    }

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        labels = attack_labels(observed, threat)
        target = [t.to(threat.device) for t in observed.tensors]
        lo, hi = threat.box()
        best, best_loss, traces = None, float("inf"), []
        for _ in range(self.restarts):
            images, trace = self._one_run(target, labels, threat, generator, lo, hi)
            with torch.no_grad():
                final = self._objective(images, labels, target, threat).detach()
            traces.append(trace)
            if final.item() < best_loss:
                best, best_loss = images, final.item()
        return Reconstruction(threat.to_pixels(best.detach()), labels, traces[0],
                              seconds=0.0, extras={"match_loss": best_loss})

    def _objective(self, images: Tensor, labels: Tensor, target: list[Tensor], threat: ThreatModel) -> Tensor:
        with torch.enable_grad():
            candidate = threat.candidate_update(images, labels)
            return cosine_distance(target, candidate) + self.tv * total_variation(images)

    def _one_run(self, target, labels, threat, generator, lo, hi) -> tuple[Tensor, list[float]]:
        shape = (threat.batch_size, *threat.input_shape)
        images = torch.randn(shape, generator=generator, device=threat.device).requires_grad_(True)
        optimiser = torch.optim.Adam([images], lr=self.lr)
        schedule = torch.optim.lr_scheduler.MultiStepLR(
            optimiser, step_decay_milestones(self.iterations), gamma=0.1)
        trace = torch.empty(self.iterations, device=threat.device)
        for it in range(self.iterations):
            loss = self._objective(images, labels, target, threat)
            (grad,) = torch.autograd.grad(loss, images)
            images.grad = grad.sign() if self.signed else grad
            optimiser.step()
            schedule.step()
            with torch.no_grad():
                images.copy_(torch.maximum(torch.minimum(images, hi), lo))
            trace[it] = loss.detach()
        return images, trace.tolist()


@hookimpl
def register_attacks():
    return [InvertingGradients]
