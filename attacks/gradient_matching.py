"""Gradient-matching attacks: optimise images whose update matches the observed one.

``inverting_gradients`` (Geiping et al. 2020): cosine distance, priors, signed Adam.
``dlg`` (Zhu et al. 2019): Euclidean distance, L-BFGS on the image and a soft label.
``idlg`` (Zhao et al. 2020): the label read from the gradient, then ``dlg`` on the image.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from leakaudit.plugins.attack import Attack, Reconstruction, ThreatModel
from leakaudit.attacks.labels import METHODS, recover_labels
from leakaudit.attacks.priors import PRIORS, check_priors, prior_penalty
from leakaudit.plugins.defense import SharedUpdate, squared_distance
from leakaudit.plugins import Param, hookimpl


def cosine_distance(observed: Sequence[Tensor], candidate: Sequence[Tensor]) -> Tensor:
    """1 - cosine similarity of the whole updates, all layers jointly (Geiping et al. 2020, Eq. 4)."""
    dot = sum((o * c).sum() for o, c in zip(observed, candidate))
    norm_o = sum((o * o).sum() for o in observed).sqrt()
    norm_c = sum((c * c).sum() for c in candidate).sqrt()
    return 1 - dot / (norm_o * norm_c).clamp_min(1e-12)


def step_decay_milestones(iterations: int) -> list[int]:
    """Learning-rate drops at 3/8, 5/8 and 7/8 of the run, as in Geiping et al. 2020."""
    return [iterations * k // 8 for k in (3, 5, 7)]


def random_images(threat: ThreatModel, generator: torch.Generator) -> Tensor:
    """A standard-normal start in normalised space, as in Geiping et al. 2020."""
    shape = (threat.batch_size, *threat.input_shape)
    return torch.randn(shape, generator=generator, device=threat.device)


def kept(tensors: list[Tensor], keep: list[bool] | None) -> list[Tensor]:
    """The tensors an attack matches: all, or those ``keep`` marks."""
    return tensors if keep is None else [t for t, k in zip(tensors, keep) if k]


def matched_tensors(observed: SharedUpdate, threat: ThreatModel) -> list[bool]:
    """Per shared tensor, whether an informed attacker matches it (not rewritten by the defense)."""
    dropped = threat.defense.defended_tensors(observed.names)
    return [n not in dropped for n in observed.names]


LABEL_METHOD = Param("auto", str, choices=METHODS, help="label recovery when labels are not known")
PRIOR_WEIGHTS = f"weights of image priors by name ({', '.join(PRIORS)})"


class InvertingGradients(Attack):
    """Cosine gradient matching with total variation, signed Adam and a box constraint (Geiping et al.)."""

    name = "inverting_gradients"
    paper = "Geiping et al. 2020"
    params = {
        "iterations": Param(4800, int, min=1, help="optimisation steps per restart"),
        "lr": Param(0.1, float, min=0.0, exclusive_min=True, help="Adam step size"),
        "priors": Param({"tv": 1e-2}, dict, help=PRIOR_WEIGHTS),
        "restarts": Param(1, int, min=1, help="random restarts; the best gradient match is kept"),
        "signed": Param(True, bool, help="use the sign of the image gradient (adversarial-attack style)"),
        "label_method": LABEL_METHOD,
        "drop_defended": Param(False, bool, help="leave out of the match the tensors the defense declares "
                                                 "rewritten (Soteria's layer: the attack of Balunovic et al. 2022, Sec. 5)"),
    }

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        check_priors(self.priors)

    @property
    def knows_defense(self) -> bool:
        return self.uses_defense or self.drop_defended

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        labels = recover_labels(observed, threat, self.label_method, generator)
        keep = matched_tensors(observed, threat) if self.drop_defended else None
        target = kept([t.to(threat.device) for t in observed.tensors], keep)
        best, best_extra, best_loss, traces = None, {}, float("inf"), []
        for _ in range(self.restarts):
            images, extra, trace = self._one_run(target, labels, threat, generator, keep)
            with torch.no_grad():
                final = self._objective(images, labels, target, threat, keep, extra).item()
            traces.append(trace)
            if final < best_loss:
                best, best_extra, best_loss = images, extra, final
        extras = {"match_loss": best_loss, **({"variables": best_extra} if best_extra else {})}
        return Reconstruction(threat.to_pixels(best.detach()), labels, traces[0], 0.0, extras)

    def _objective(self, images: Tensor, labels: Tensor, target: list[Tensor], threat: ThreatModel,
                   keep: list[bool] | None, extra: dict[str, list[Tensor]]) -> Tensor:
        """The matching loss of one candidate; ``extra`` holds the unknowns optimised beside the images."""
        lo, hi = threat.box()
        with torch.enable_grad():
            candidate = kept(threat.candidate_update(images, labels), keep)
            return cosine_distance(target, candidate) + prior_penalty(images, self.priors, lo, hi)

    def _extra_variables(self, threat: ThreatModel, generator: torch.Generator) -> dict[str, list[Tensor]]:
        """Unknowns optimised beside the images (none here; drawn after the start image, so starts stay paired)."""
        return {}

    def _one_run(self, target, labels, threat, generator, keep) -> tuple[Tensor, dict[str, list[Tensor]], list[float]]:
        lo, hi = threat.box()
        images = random_images(threat, generator).requires_grad_(True)
        extra = self._extra_variables(threat, generator)
        variables = [images, *(v for vs in extra.values() for v in vs)]
        optimiser = torch.optim.Adam(variables, lr=self.lr)
        schedule = torch.optim.lr_scheduler.MultiStepLR(optimiser, step_decay_milestones(self.iterations), 0.1)
        trace = torch.empty(self.iterations, device=threat.device)
        for it in range(self.iterations):
            loss = self._objective(images, labels, target, threat, keep, extra)
            for v, grad in zip(variables, torch.autograd.grad(loss, variables)):
                v.grad = grad.sign() if self.signed else grad
            optimiser.step()
            schedule.step()
            with torch.no_grad():
                images.copy_(torch.maximum(torch.minimum(images, hi), lo))
            trace[it] = loss.detach()
        return images, extra, trace.tolist()


class DeepLeakage(Attack):
    """Euclidean gradient matching by L-BFGS on the image and a soft label jointly, with restarts (Zhu et al.)."""

    name = "dlg"
    paper = "Zhu et al. 2019"
    params = {
        "iterations": Param(300, int, min=1, help="L-BFGS steps per restart"),
        "lr": Param(1.0, float, min=0.0, exclusive_min=True, help="L-BFGS step size"),
        "restarts": Param(4, int, min=1, help="random restarts; the best gradient match is kept"),
        "line_search": Param(True, bool, help="strong-Wolfe line search (off: fixed steps, as the DLG code)"),
        "priors": Param({}, dict, help=PRIOR_WEIGHTS),
    }

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        check_priors(self.priors)

    def _labels(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Tensor | None:
        """Fixed labels, or None when they are optimised jointly as soft labels."""
        return threat.labels.to(threat.device) if threat.labels is not None else None

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        fixed = self._labels(observed, threat, generator)
        target = [t.to(threat.device) for t in observed.tensors]
        best = None
        for _ in range(self.restarts):
            run = self._one_run(target, fixed, threat, generator)
            if best is None or run[2] < best[2]:
                best = run
        images, labels, loss, trace = best
        return Reconstruction(threat.to_pixels(images), labels, trace, 0.0, {"match_loss": loss})

    def _one_run(self, target, fixed, threat, generator):
        lo, hi = threat.box()
        images = random_images(threat, generator).requires_grad_(True)
        variables = [images]
        logits = None
        if fixed is None:
            logits = torch.randn((threat.batch_size, threat.num_classes), generator=generator,
                                 device=threat.device).requires_grad_(True)
            variables.append(logits)
        optimiser = torch.optim.LBFGS(variables, lr=self.lr, max_iter=20, history_size=100,
                                      line_search_fn="strong_wolfe" if self.line_search else None)

        def objective() -> Tensor:
            targets = fixed if logits is None else torch.softmax(logits, dim=-1)
            candidate = threat.candidate_update(images, targets)
            return squared_distance(target, candidate) + prior_penalty(images, self.priors, lo, hi)

        def closure() -> Tensor:
            loss = objective()
            grads = torch.autograd.grad(loss, variables)
            for v, g in zip(variables, grads):
                v.grad = g
            return loss.detach()

        trace = []
        for _ in range(self.iterations):
            loss = optimiser.step(closure)
            trace.append(loss)
            if not torch.isfinite(loss) or loss.item() == 0.0:
                break
        final = objective().item()
        labels = fixed if logits is None else logits.detach().argmax(dim=-1)
        final = final if final == final else float("inf")  # NaN from a diverged run loses
        return images.detach(), labels, final, torch.stack(trace).tolist()


class ImprovedDeepLeakage(DeepLeakage):
    """The label read from the gradient's signs, then Euclidean matching by L-BFGS on the image only (Zhao et al.)."""

    name = "idlg"
    paper = "Zhao et al. 2020"
    params = {**DeepLeakage.params, "label_method": LABEL_METHOD}

    def _labels(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Tensor:
        return recover_labels(observed, threat, self.label_method, generator)


@hookimpl
def register_attacks():
    return [InvertingGradients, DeepLeakage, ImprovedDeepLeakage]
