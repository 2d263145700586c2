"""One step: the shared updates of an audited batch turned into judged rows, whoever audits it.

The runner (``AuditWorker.attack``: one attack on a cell's target batches, solved together), every monitor
(``MonitorCore._attack``: each attack of a setting on the step's one update) and ``audit_batch`` call ``judge_updates``,
with the attacker's knowledge built by ``threat_model``; nothing else makes a results row (``Row``). An attack
that raises is raised (an audit stops on it) or, given ``failed``, listed while the others run (a monitor).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from leakaudit.evaluator.audit.jobs import AttackJob
from leakaudit.evaluator.results.rows import Row
from leakaudit.evaluator.results.verdict import late_gain
from leakaudit.evaluator.run.modality import Modality
from leakaudit.evaluator.zoo.metrics import Scores, score
from leakaudit.plugins.attack import (AuxiliaryData, Problem, Reconstruction, ThreatModel, alone_coordinates,
                                     own_coordinates_problem, solve)
from leakaudit.plugins.components import Metric
from leakaudit.plugins.defense import Defense
from leakaudit.plugins.protocol import LossFn, Protocol
from leakaudit.plugins.spec import one_line


def threat_model(model: nn.Module, loss_fn: LossFn, input_shape: tuple[int, ...], mean: Tensor, std: Tensor,
                 num_classes: int, batch_size: int, defense: Defense, labels: Tensor, known_labels: bool,
                 device: torch.device, protocol: Protocol, auxiliary: AuxiliaryData | None) -> ThreatModel:
    """What the server knows of one update, for an audit file's scenario and a live model alike: the labels only
    where the threat model gives them, the attacker's own data (``auxiliary``) where it has some."""
    return ThreatModel(model=model, loss_fn=loss_fn, input_shape=input_shape, mean=mean, std=std,
                       num_classes=num_classes, batch_size=batch_size, defense=defense,
                       labels=labels if known_labels else None, device=device, protocol=protocol, auxiliary=auxiliary)


@dataclass
class Read:
    """How one shared update is attacked: the problem, the originals and labels its reconstruction is scored
    against, and how many coordinates were read as the first client's own (None: not read per coordinate)."""

    problem: Problem
    originals: Tensor
    labels: Tensor
    own_coordinates: int | None = None


def read_update(problem: Problem, originals: Tensor, labels: Tensor) -> Read:
    """The problem of a shared update as the attacker reads it: where per-element secure aggregation shows
    coordinates the first client alone sent, that client's own update there (``own_coordinates_problem``), scored
    against that client's images alone; else the update as shared, with 0 where the aggregate showed no such
    coordinate (None where it shows no contributors, or the defense's noise leaves no exact value to read)."""
    count = alone_coordinates(problem.observed)
    own = own_coordinates_problem(problem)
    if own is None:
        return Read(problem, originals, labels, 0 if count == 0 else None)
    n = own.threat.batch_size
    return Read(own, originals[:n], labels[:n], count)


@dataclass
class Update:
    """One attacked update: the job it answers, the problem an attack solves, and the originals (what the attacks
    rebuild) with their labels and their indices in the data, which its reconstruction is scored against;
    ``own_coordinates`` as ``Read`` has it."""

    job: AttackJob
    problem: Problem
    originals: Tensor
    labels: Tensor
    images: list[int]
    own_coordinates: int | None = None


@dataclass
class Judging:
    """How a step's rows are judged: the metrics and the modality, the setting's epsilon and identification bound,
    the GDP ``mu`` and ``confidence`` of the prior-free corridor (None: none drawn), the personal values a
    reconstruction recovers (``personal(aligned, update)``), and where reconstructions are kept for the report."""

    metrics: list[Metric]
    modality: Modality
    epsilon: float | None = None
    bound: float | None = None
    mu: float | None = None
    confidence: float | None = None
    personal: Callable[[Tensor, Update], float | None] | None = None
    keep: Callable[[AttackJob, dict[str, Any]], None] | None = None


@dataclass
class Judged:
    """One reconstruction, scored, and its row."""

    update: Update
    reconstruction: Reconstruction
    scores: Scores
    row: Row


def judge_updates(groups: Iterable[Sequence[Update]], judging: Judging, max_problems: int | None = None,
          failed: list[tuple[Update, str]] | None = None,
          fail_as: Callable[[Update, Exception], Exception] | None = None) -> list[Judged]:
    """Solve each group (one attack's updates, vectorised together; a group is made as its turn comes), score every reconstruction and make its row.
    A group whose attack raises is listed in ``failed`` (its error on one line) and the others still run; without
    ``failed`` the error propagates, as ``fail_as(update, error)`` where given."""
    out = []
    for group in groups:
        try:
            recs = solve([u.problem for u in group], max_problems)
            if failed is not None:  # a monitor: scoring and keeping fail as the attack's failure, the rest go on
                out += [_judged(u, rec, judging) for u, rec in zip(group, recs)]
                continue
        except Exception as exc:
            if failed is None:
                if fail_as is None:
                    raise
                raise fail_as(group[0], exc) from None
            failed.append((group[0], one_line(exc)))
            continue
        out += [_judged(u, rec, judging) for u, rec in zip(group, recs)]
    return out


def _judged(update: Update, rec: Reconstruction, judging: Judging) -> Judged:
    """Score one reconstruction, keep it (aligned to its originals) for the report, and make its row."""
    scores = score(judging.metrics, rec.images, update.originals, rec.labels, update.labels)
    aligned = rec.images[scores.order]
    if judging.keep is not None:
        judging.keep(update.job, {"original": update.originals.cpu(), "reconstruction": aligned.detach().cpu(),
                                  "labels": update.labels.cpu(), "recovered_labels": rec.labels.cpu(),
                                  "loss_trace": rec.loss_trace})
    job, modality = update.job, judging.modality
    row = Row(defense=job.setting.name, setting=job.setting.key, params=job.setting.params, attack=job.attack.key,
              attack_name=job.attack.name, checkpoint=job.checkpoint, target=job.target, images=update.images,
              epsilon=judging.epsilon, rero_bound=judging.bound, metrics=scores.values, per_image=scores.per_image,
              late_gain=late_gain(rec.loss_trace), seconds=round(rec.seconds, 3), attack_params=job.params,
              notes=scores.notes,
              prior_free=None if judging.confidence is None else modality.prior_free(
                  judging.mu, update.originals, judging.confidence),  # once per row, after the attack
              pii_recall=None if judging.personal is None else modality.recall(judging.personal, aligned, update),
              own_coordinates=update.own_coordinates)
    return Judged(update, rec, scores, row)
