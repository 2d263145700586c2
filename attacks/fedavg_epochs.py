"""Gradient matching through FedAvg's local epochs in an order the attacker does not know: ``fedavg_epochs``
(Dimitrov et al. 2022, "Data Leakage in Federated Averaging", TMLR).

The client shuffles its images every epoch, so which images formed which local batch is unknown. The attack
reconstructs one copy of the client's images per epoch, simulates the local SGD steps with each epoch's copies in
batches of their own, and adds an epoch-order-invariant prior: each later epoch's copies are matched to the first
epoch's within a label (a soft assignment, Sinkhorn's) and pulled towards them. The answer is every image's copies,
matched by an exact assignment, averaged.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn
from torch.func import functional_call
from typing_extensions import Self

from leakaudit.attacks.gradient_matching import LABEL_METHOD, PRIOR_WEIGHTS, step_decay_milestones
from leakaudit.attacks.labels import recover_labels
from leakaudit.attacks.priors import check_priors
from leakaudit.attacks.vectorised import (
    Batch,
    SharedModel,
    optimise,
    prior_sum,
    problem_hyper,
    solve_all,
    stack_targets,
    stacked_state,
    vectorisable,
)
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.attack import HONEST_SERVER, MAX_ITERATIONS, Attack, Problem, Reconstruction, ThreatModel
from leakaudit.plugins.defense import SharedUpdate, cosine_distance
from leakaudit.plugins.protocol import FedAvg, LossFn, Protocol
from leakaudit.plugins.stochastic import stochastic_modules

#: Sinkhorn's row and column normalisations per soft assignment.
SINKHORN_ROUNDS = 10


def epochs_update(module: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor], loss_fn: LossFn,
                  copies: Tensor, labels: Tensor, protocol: FedAvg) -> list[Tensor]:
    """``theta_before - theta_after`` of local SGD where epoch ``e`` trains on ``copies[e]`` in batches of the
    protocol's size, each slot with its label: a pure function of ``copies`` (torch.func)."""
    current = dict(params)
    b = protocol.local_batch_size or len(labels)
    for copy in copies:
        for i in range(0, len(labels), b):
            def loss(p: dict[str, Tensor], x: Tensor = copy[i:i + b], y: Tensor = labels[i:i + b]) -> Tensor:
                return loss_fn(functional_call(module, (p, buffers), (x,)), y)

            grads = torch.func.grad(loss)(current)
            current = {n: p - protocol.local_lr * grads[n] for n, p in current.items()}
    return [params[n] - current[n] for n in params]


def copy_costs(copies: Tensor) -> Tensor:
    """(E - 1, n, n): the mean squared distance of each later epoch's copies to each of the first epoch's."""
    flat = copies.flatten(2)
    first, later = flat[0], flat[1:]
    cross = later @ first.T
    return (later.square().sum(-1, keepdim=True) + first.square().sum(-1)[None, None] - 2 * cross) / flat.shape[-1]


def invariant_prior(copies: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """Dimitrov et al. 2022's epoch-order-invariant prior: each later epoch's copies softly assigned (Sinkhorn, at
    ``temperature`` times the mean cost) to the first epoch's copies of the same label, and their mean squared
    distance under that assignment, over the images once more: the update's match spreads over the images, so
    each image's pull weighs as much whatever their number. Independent of the order of every epoch's copies."""
    if len(copies) < 2:
        return copies.new_zeros(())
    costs = copy_costs(copies)
    same = labels[:, None] == labels[None, :]
    scale = temperature * costs.detach().mean().clamp_min(1e-12)
    # clamped: exp of a logit near -700 is subnormal, which takes CPUs a hundred times longer
    logits = (-costs.detach() / scale).clamp_min(-50).masked_fill(~same, float("-inf"))
    for _ in range(SINKHORN_ROUNDS):
        logits = logits - logits.logsumexp(-1, keepdim=True)
        logits = logits - logits.logsumexp(-2, keepdim=True)
    return (logits.exp() * costs).sum((-2, -1)).mean() / len(labels) ** 2


def local_epochs(threat: ThreatModel) -> int:
    """The FedAvg client's local epochs (``unsupported`` refuses every other protocol before any work)."""
    assert isinstance(threat.protocol, FedAvg), "fedavg_epochs reads FedAvg updates only"
    return threat.protocol.local_epochs


def merged_copies(copies: Tensor, labels: Tensor) -> Tensor:
    """Each image's copies averaged: every later epoch's copies matched to the first epoch's by an exact
    assignment within a label (scipy's, imported here: listing the plugins must not load it), once, after the
    optimisation."""
    from scipy.optimize import linear_sum_assignment

    if len(copies) < 2:
        return copies[0]
    costs = copy_costs(copies).masked_fill(~(labels[:, None] == labels[None, :]), float("inf"))
    table = costs.nan_to_num(posinf=1e30).cpu().numpy()
    merged = copies[0].clone()
    for e, cost in enumerate(table, start=1):
        rows, cols = linear_sum_assignment(cost)
        merged[torch.as_tensor(cols, device=copies.device)] += copies[e][torch.as_tensor(rows, device=copies.device)]
    return merged / len(copies)


class FedAvgEpochs(Attack):
    """A FedAvg client's images from its update after several local epochs over batches in an unknown order: one
    copy per epoch simulated through local SGD, pulled together by an epoch-order-invariant prior, matched and
    averaged (Dimitrov et al. 2022)."""

    name = "fedavg_epochs"
    paper = "Dimitrov et al. 2022"
    attacker = HONEST_SERVER
    brings = "a copy of the images per local epoch, for FedAvg updates whose batch order the server does not know"
    #: The paper's budget, 400 Adam steps (200 attack epochs of two steps), on either device: on the CPU 64 images of
    #: Fashion-MNIST take under a minute, and 1,000 steps did no better (docs/results.md).
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {"iterations": 400}, "cuda": {"iterations": 400}}
    params = {
        "iterations": Param(400, int, min=1, max=MAX_ITERATIONS, help="optimisation steps per restart",
                            budget=True),
        "lr": Param(0.1, float, min=0.0, exclusive_min=True, help="Adam step size"),
        "priors": Param({"tv": 1e-2}, dict, help=PRIOR_WEIGHTS),
        "invariant": Param(1.0, float, min=0.0, help="weight of the epoch-order-invariant prior that pulls each "
                                                     "image's per-epoch copies together"),
        "temperature": Param(0.05, float, min=0.0, exclusive_min=True,
                             help="softness of the prior's assignment of copies, a share of their mean distance"),
        "restarts": Param(1, int, min=1, help="random restarts; the best update match is kept"),
        "signed": Param(True, bool, help="use the sign of the image gradient (as Inverting Gradients)"),
        "label_method": LABEL_METHOD,
    }
    iterations: int
    lr: float
    priors: dict[str, Any]
    invariant: float
    temperature: float
    restarts: int
    signed: bool
    label_method: str

    #: Settings that may differ between problems solved in one pass.
    per_problem: ClassVar[frozenset[str]] = frozenset({"lr", "priors", "invariant"})

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        check_priors(self.priors)

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if not isinstance(protocol, FedAvg):
            return f"{self.name} reads a FedAvg client's local training (protocol {protocol.name} sends no such update)"
        if protocol.clients > 1:
            return f"{self.name} reads one client's local training (clients: {protocol.clients} averages several)"
        steps = protocol.local_steps(batch_size)
        if steps < 2:
            return (f"{self.name} needs more than one local step (fedavg takes {steps} here), where one step is a "
                    "gradient that inverting_gradients reads")
        if any(m.draws_noise for m in stochastic_modules(model)) or \
                any(m._backward_hooks or m._backward_pre_hooks for m in model.modules()):
            return (f"{self.name} simulates local training through torch.func, which a model that draws noise "
                    "inside or carries backward hooks does not pass")
        return None

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        batch, solve = self._batch([Problem(observed, threat, generator, self)])
        return solve(batch)[0]

    @classmethod
    def reconstruct_all(cls, problems: list[Problem[Self]], max_problems: int | None = None) -> list[Reconstruction]:
        """Problems with like settings, and their restarts, optimised together in one vmapped pass."""
        return solve_all(cls, problems, max_problems, per_problem=cls.per_problem, can_vectorise=lambda t: True,
                         build=cls._batch, images=lambda p: local_epochs(p.threat),
                         rows=lambda p: p.attack.restarts)

    @classmethod
    def _batch(cls, problems: list[Problem[Self]]) -> tuple[Batch, Callable[[Batch], list[Reconstruction]]]:
        """The problems' rows (restarts): each a start of one copy per epoch, its labels in a drawn order."""
        threat = problems[0].threat
        if not vectorisable(threat):
            raise ValueError(f"{cls.name}: the model draws noise or carries backward hooks, which torch.func's "
                             "simulation of local training cannot pass")
        epochs = local_epochs(threat)
        labels, starts = [], []
        for p in problems:  # each problem's draws in the order it makes them alone: labels, their order, starts
            found = recover_labels(p.observed, p.threat, p.attack.label_method, p.generator)
            order = torch.randperm(len(found), generator=p.generator, device=p.generator.device).to(found.device)
            labels.append(found[order])
            for _ in range(p.attack.restarts):
                shape = (epochs * p.threat.batch_size, *p.threat.input_shape)
                starts.append(torch.randn(shape, generator=p.generator, device=threat.device))
        owners = [i for i, p in enumerate(problems) for _ in range(p.attack.restarts)]
        attacks = [problems[i].attack for i in owners]
        hyper = {**problem_hyper(attacks, threat.device),
                 "invariant": torch.tensor([a.invariant for a in attacks], device=threat.device),
                 "state": stacked_state([problems[i].threat.model for i in owners])}
        batch = Batch(problems, torch.stack(starts), torch.stack([labels[i] for i in owners]),
                      stack_targets([problems[i].observed for i in owners], threat.device), {}, {}, hyper, owners)
        return batch, lambda b: cls._solve(b, labels)

    @classmethod
    def _solve(cls, batch: Batch, labels: list[Tensor]) -> list[Reconstruction]:
        first, threat = batch.problems[0].attack, batch.problems[0].threat
        shared = SharedModel.of(threat.model)
        protocol: FedAvg = threat.protocol  # type: ignore[assignment]  # unsupported() admits FedAvg alone
        epochs, lo, hi = protocol.local_epochs, *threat.box()
        loss_fn = threat.defense.client_loss(shared.module, threat.loss_fn)

        def objective(images, labels, target, metadata, hyper, unknowns):
            params, buffers = (hyper["state"]["params"], hyper["state"]["buffers"]) if hyper["state"] else \
                (shared.params, shared.buffers)
            copies = images.view(epochs, -1, *images.shape[1:])
            delta = epochs_update(shared.module, params, buffers, loss_fn, copies, labels, protocol)
            return (cosine_distance(target, delta) + prior_sum(images, hyper, lo, hi)
                    + hyper["invariant"] * invariant_prior(copies, labels, first.temperature))

        milestones = step_decay_milestones(first.iterations)
        images, _, trace = optimise(batch, objective, iterations=first.iterations, signed=first.signed, box=(lo, hi),
                                    lr_factor=lambda it: 0.1 ** bisect.bisect_right(milestones, it))
        with torch.no_grad():
            final = torch.func.vmap(objective)(images, batch.labels, batch.targets, batch.metadata, batch.hyper, {})
        return [cls._answer(p, i, batch, images, final, trace, labels[i]) for i, p in enumerate(batch.problems)]

    @staticmethod
    def _answer(problem: Problem, index: int, batch: Batch, images: Tensor, final: Tensor, trace: Tensor,
                labels: Tensor) -> Reconstruction:
        """One problem's reconstruction: its best restart's copies matched and averaged."""
        rows = [r for r, o in enumerate(batch.owners) if o == index]
        best = min(rows, key=lambda r: float(final[r]))
        epochs = local_epochs(problem.threat)
        merged = merged_copies(images[best].detach().view(epochs, -1, *images.shape[2:]), labels)
        return Reconstruction(problem.threat.to_pixels(merged), labels, trace[:, rows[0]].tolist(), 0.0,
                              {"match_loss": float(final[best])})


@hookimpl
def register_attacks():
    return [FedAvgEpochs]
