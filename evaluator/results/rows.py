"""The results row: one attack's scores on one target batch, as results.jsonl stores it and the CSV reads it.

Only the step (``evaluator/run/step.py``) makes a ``Row``; ``to_json`` writes results.jsonl's line (the metrics
flattened beside the fixed keys, in the order every run folder holds them) and ``from_json`` reads one back.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

#: Keys written only when the row has them, in this order after the fixed ones.
OPTIONAL = ("attack_params", "notes", "prior_free", "pii_recall", "own_coordinates")
#: What a row written before a key was kept reads as (images, epsilon, the bound, per-image scores, late gain).
OLDER_DEFAULTS: dict[str, Any] = {"params": {}, "images": [], "epsilon": None, "rero_bound": None, "per_image": {},
                                  "late_gain": None}


@dataclass
class Row:
    """One judged reconstruction: which job it answers, the guarantee beside it, its scores and how it ran."""

    defense: str
    setting: str
    params: dict[str, Any]
    attack: str
    attack_name: str
    checkpoint: int
    target: int
    images: list[int]  # the data's indices of the batch's originals
    epsilon: float | None
    rero_bound: float | None  # the most any attack can identify under the setting's guarantee
    metrics: dict[str, float | None]  # batch means, flattened into the row's keys
    per_image: dict[str, list[float]]
    late_gain: float | None
    seconds: float
    attack_params: dict[str, Any] | None = None  # a tuned winner's parameters
    notes: list[str] = field(default_factory=list)  # metrics that could not be computed
    prior_free: dict[str, float] | None = None  # the prior-free corridor (images under a GDP guarantee)
    pii_recall: float | None = None  # personal values recovered verbatim (text that marks them)
    #: Per-element secure aggregation: the coordinates read as the first client's own, its images alone scored
    #: (0: none had one contributor, the aggregate attacked); None where the update was not read per coordinate.
    own_coordinates: int | None = None

    def to_json(self) -> dict[str, Any]:
        """results.jsonl's line: the fixed keys, the metrics, then the optional keys the row has."""
        out = {f.name: getattr(self, f.name) for f in fields(self)[:10]}
        out |= self.metrics
        out |= {"per_image": self.per_image, "late_gain": self.late_gain, "seconds": self.seconds}
        return out | {k: getattr(self, k) for k in OPTIONAL if getattr(self, k) not in (None, [])}

    @property
    def key(self) -> tuple[str, str, int, int]:
        """The job the row answers: (setting, attack, checkpoint, target), as ``AttackJob.key``."""
        return (self.setting, self.attack, self.checkpoint, self.target)

    @property
    def cell(self) -> tuple[str, str, int]:
        """The (setting, attack, checkpoint) whose statistics the row enters."""
        return (self.setting, self.attack, self.checkpoint)

    def per_image_of(self, metric: str) -> list[float | None]:
        """The row's per-image scores of ``metric`` (a row from before per-image scores: its batch mean)."""
        found: list[float | None] = list(self.per_image.get(metric, []))
        return found or [self.metrics.get(metric)]

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> "Row":
        """A row read back from results.jsonl: every key that is not a field is a metric's batch mean; a key that
        rows of an older layout lack reads as empty."""
        names = {f.name for f in fields(cls)}
        older = {k: copy.copy(v) for k, v in OLDER_DEFAULTS.items()}  # each row its own empty list or dict
        known = {**older, "attack_name": row["attack"], **{k: v for k, v in row.items() if k in names}}
        return cls(**known, metrics={k: v for k, v in row.items() if k not in names})
