"""An audit's units of work: attack jobs, tuning trials, the cells that group them, and their keys in the rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from leakaudit.evaluator.audit.seeds import derive_seed
from leakaudit.evaluator.audit.tuning import candidates, scan_best, scan_candidates
from leakaudit.evaluator.audit.types import AttackSpec, Audit, DefenseSetting
from leakaudit.plugins.manager import Registry


@dataclass(frozen=True)
class AttackJob:
    """One cell of the audit: a defense setting, a checkpoint, a target batch and an attack.

    ``params`` replaces the attack's audit parameters (the tuned winner) when set.
    """

    setting: DefenseSetting
    attack: AttackSpec
    checkpoint: int
    target: int
    params: dict | None = None

    @property
    def key(self) -> tuple:
        return (self.setting.key, self.attack.key, self.checkpoint, self.target)


@dataclass(frozen=True)
class TuneJob:
    """One trial of an attack's hyperparameter search on the tuning images."""

    setting: DefenseSetting
    attack: AttackSpec
    checkpoint: int
    trial: int
    params: dict
    stage: str = "grid"  # "scan": the first stage of a two-stage search (tune.scan), else "grid"

    @property
    def key(self) -> tuple:
        return (self.setting.key, self.attack.key, self.checkpoint, self.trial)


@dataclass(frozen=True)
class Cell:
    """Jobs of one (setting, attack, checkpoint) solved together as one problem set: attack jobs (one per
    target batch) or tuning trials. A worker runs a cell; its rows are written when it finishes."""

    jobs: tuple

    @property
    def first(self):
        return self.jobs[0]


def jobs_of(audit: Audit, tuned: dict[tuple, dict] | None = None) -> list[AttackJob]:
    """Every attack job of an audit, in order (``tuned``: the winning parameters per setting, attack, step)."""
    tuned = tuned or {}
    return [AttackJob(s, a, c, t, tuned.get((s.key, a.key, c), {}).get("params"))
            for s in audit.settings for c in audit.checkpoints for t in range(audit.num_batches_of(s))
            for a in audit.attacks
            if a.applies_to(s) and a.runs_at(c)]


def cells_of(jobs: list, workers: int, registry: Registry) -> list[Cell]:
    """``jobs`` grouped by (setting, attack, checkpoint), in order, as cells for ``workers`` processes: whole
    groups when there are enough of them to keep every process busy, else each group cut in ``workers`` parts,
    except an attack's that learns once per cell (``Attack.learns_per_cell``): its group stays whole."""
    groups: dict[tuple, list] = {}
    for job in jobs:
        groups.setdefault((job.setting.key, job.attack.key, job.checkpoint), []).append(job)
    largest = max(map(len, groups.values()), default=1)
    per_cell = max(1, largest if len(groups) >= 2 * workers else -(-largest // workers))
    return [Cell(tuple(group[i:i + size])) for group in groups.values()
            for size in [len(group) if registry.get("attack", group[0].attack.name).learns_per_cell else per_cell]
            for i in range(0, len(group), size)]


def trial_key(row: dict[str, Any]) -> tuple:
    """The ``TuneJob.key`` of a tuning row."""
    return (row["setting"], row["attack"], row["checkpoint"], row["trial"])


def tune_jobs_of(audit: Audit, tried: Sequence[dict] = ()) -> list[TuneJob]:
    """Every tuning trial known so far: a scanning search's grid trials appear once ``tried`` (the tuning
    rows) holds its whole scan."""
    jobs = []
    for a in (a for a in audit.attacks if a.tune is not None):
        assert a.tune is not None  # the loop takes the tuned attacks
        cls = audit.registry.get("attack", a.name)
        defaults = {k: p.default for k, p in cls.params.items() if not p.required}
        seed = derive_seed(audit.seed, "tune", a.identity)
        scanned = len(scan_candidates(a.tune, a.params, defaults)) if a.tune.scan else 0
        for s, c in ((s, c) for s in audit.settings if a.applies_to(s) for c in audit.checkpoints if a.runs_at(c)):
            best = None
            if a.tune.scan:
                mine = [r for r in tried if (r["setting"], r["attack"], r["checkpoint"]) == (s.key, a.key, c)]
                best = scan_best(a.tune, mine, scanned, audit.registry)
            jobs += [TuneJob(s, a, c, i, p, "scan" if i < scanned else "grid")
                     for i, p in enumerate(candidates(a.tune, a.params, defaults, seed, best))]
    return jobs


def job_at(audit: Audit, setting: str, attack: str, checkpoint: int, target: int) -> AttackJob:
    """The attack job of a results row's key, to find its saved reconstruction."""
    return AttackJob(next(s for s in audit.settings if s.key == setting),
                     next(a for a in audit.attacks if a.key == attack), checkpoint, target)
