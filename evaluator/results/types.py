"""The typed results of an audit: what summary.json holds, as the runner and the monitor fill it and the
figures, the page and the gate read it.

``Summary.to_json`` writes the layout of summary.json (a metric's statistics flattened to ``{metric}_mean``,
``_std``, ``_ci``, ``_n``, as the files of earlier releases have them) and ``Summary.from_json`` reads it back,
from this release's folders or an older one's. ``SUMMARY_VERSION`` numbers the layout: a folder written
before it was numbered reads as version 1.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from leakaudit.evaluator.audit.types import VerdictSection

#: The layout of summary.json this release writes; it reads this one and every earlier one.
SUMMARY_VERSION = 4
STATISTICS = ("mean", "std", "ci", "n")
#: What a verdict may add about how firm it is (StepVerdict's and WorstCase's fields; written where set).
OPEN_QUESTIONS = ("weak", "borderline", "budget")


@dataclass(frozen=True)
class Scores:
    """One metric over a cell's images: mean, sample standard deviation, bootstrap interval, count."""

    mean: float | None = None
    std: float | None = None
    ci: list[float] | None = None
    n: int = 0

    def flat(self, metric: str) -> dict[str, Any]:
        """As summary.json writes it: ``{metric}_mean``, ``_std``, ``_ci``, ``_n``."""
        return {f"{metric}_{k}": getattr(self, k) for k in STATISTICS}

    @classmethod
    def read(cls, record: dict[str, Any], metric: str) -> Scores:
        return cls(mean=record.get(f"{metric}_mean"), std=record.get(f"{metric}_std"), ci=record.get(f"{metric}_ci"),
                   n=record.get(f"{metric}_n", 0))


@dataclass(frozen=True)
class WorstImage:
    """The single most leaking image: its attack, step, score, target batch, place in the batch, dataset index."""

    attack: str
    checkpoint: int
    score: float
    target: int
    index: int
    image: int | None = None


@dataclass(frozen=True)
class LeakThreshold:
    """The score an attack must beat to leak: the better no-gradient guess (name, score) plus the margin.
    ``missing``: guesses that could not be made (the mean image, where the attacker holds no data besides the
    attacked batch), so that the bar may be too low; written to summary.json only where some are."""

    value: float
    guess: str
    guess_score: float
    margin: float
    missing: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        if not self.missing:
            record.pop("missing")
        return record


class _Scored:
    """A record with a metric's statistics under ``scores`` (written flat, in the fields' place)."""

    scores: dict[str, Scores]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # every subclass is a dataclass

    def mean(self, metric: str) -> float | None:
        """The mean ``metric`` (None where it has none)."""
        return self.scores.get(metric, Scores()).mean

    def ci(self, metric: str) -> list[float] | None:
        """The interval of the mean ``metric`` (None where it has none)."""
        return self.scores.get(metric, Scores()).ci

    def _around_scores(self, *leave_out: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The fields declared before ``scores`` and those after it, some left out: summary.json writes the
        scores between them."""
        names = [f.name for f in dataclasses.fields(self) if f.name not in leave_out]
        cut = names.index("scores")
        return ({k: getattr(self, k) for k in names[:cut]}, {k: getattr(self, k) for k in names[cut + 1:]})


@dataclass(frozen=True)
class CellResult(_Scored):
    """One (setting, attack, step): the statistics of every metric, identification, and convergence."""

    defense: str
    setting: str
    params: dict[str, Any]
    attack: str
    role: str
    checkpoint: int
    targets: int
    accuracy: float | None
    epsilon: float | None
    scores: dict[str, Scores]
    worst_image: WorstImage | None = None
    identifiable: float | None = None
    named: float | None = None
    identifiable_by: str | None = None
    identifiable_n: int = 0
    #: The identification test against a guess that knows the classes: a batch's originals named among same-class
    #: decoys (``verdict.decoy_test``), or one image per update nearest its own original among the targets
    #: (``verdict.class_aware_test``), and the p-value of as many under the null that the reconstructions know only
    #: their classes.
    decoy_hits: int | None = None
    decoy_p: float | None = None
    rero_bound: float | None = None
    bound_violated: str | None = None
    late_gain: float | None = None
    still_improving: bool | None = None
    iterations: int | None = None
    seconds_mean: float | None = None
    #: Text: the mean share of the targets' personal values (names, numbers) the reconstructions hold verbatim;
    #: None where the data marks none (and left out of summary.json there).
    pii_recall: float | None = None
    #: Per-element secure aggregation: per update (in target order), the coordinates read as the first client's
    #: own (0: none had one contributor, the aggregate attacked); None where no update was read per coordinate (and
    #: left out of summary.json there).
    own_coordinates: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        absent = tuple(k for k in ("pii_recall", "own_coordinates") if getattr(self, k) is None)
        head, tail = self._around_scores("worst_image", *absent)
        flat = {k: v for m, s in self.scores.items() for k, v in s.flat(m).items()}
        return {**head, **flat, "worst_image": _record(self.worst_image), **tail}

    @classmethod
    def from_json(cls, record: dict[str, Any], metrics: list[str]) -> CellResult:
        scores = {m: Scores.read(record, m) for m in metrics if f"{m}_mean" in record}
        return cls(**_known(cls, record), scores=scores, worst_image=_image(record.get("worst_image")))


@dataclass(frozen=True)
class ThreatVerdict:
    """A verdict judged on the attacks one threat model allows: those whose declared attacker is that one or a
    weaker one (Carletti et al. 2025), each calibrated by its reference judged on the same attacks."""

    threat: str
    verdict: str | None
    level: str | None
    attack: str
    checkpoint: int
    attacks: list[str]

    @classmethod
    def read(cls, records: list[dict[str, Any]] | None) -> list[ThreatVerdict] | None:
        """The records summary.json holds, as ThreatVerdicts (None where it holds none)."""
        return None if records is None else [cls(**r) for r in records]


@dataclass(frozen=True)
class StepVerdict:
    """A setting's verdict at one step, its strongest attack's evidence, and (once calibrated into
    "inconclusive") the verdict it had alone."""

    setting: str
    defense: str
    checkpoint: int
    attack: str
    score: float
    ci: list[float]
    statistic: str
    compared: float
    threshold: float | None
    accuracy: float | None
    min_accuracy: float | None
    still_improving: bool | None
    settling_iterations: int | None
    verdict: str | None
    reason: str
    alone: str | None = None
    #: The attack that broke the undefended reference at this step, which a "protects" stands on (None: the setting
    #: is its own reference, or its verdict is not a "protects").
    calibrated_by: str | None = None
    #: What the verdict says leaks: "individuals", "labels" (the classes alone) or "nothing"; None where it is not
    #: judged, or inconclusive.
    level: str | None = None
    #: The attacker the verdict holds against (Carletti et al. 2025): for a leak, the least one its attack needs;
    #: else the strongest that the attacks run need ("" where a plugin attack declares none).
    threat: str | None = None
    #: Why a leak of individuals is weak: the originals identified, but no reconstruction closer than the guesses
    #: that read nothing of the update (a weak break of a reference vouches for no "protects"); None where not.
    weak: str | None = None
    #: The level a weak break vouches for as a reference's verdict ("labels" or "nothing"; None: its level).
    vouches: str | None = None
    #: Why the verdict is borderline: its interval straddles a bar between levels, or its identification is at
    #: chance while its mean clears the bar; None where it is clear.
    borderline: str | None = None
    #: How the audit's budget leaves the verdict open: an attack that runs on the setting was left out, or scaled
    #: down without still breaking the reference; a "protects" is then inconclusive, a leak of labels may be one of
    #: individuals in full. None where the budget cut nothing this verdict rests on.
    budget: str | None = None
    #: The verdict under each threat model the attacks run span, weakest attacker first; None where they span one.
    by_threat: list[ThreatVerdict] | None = None

    def to_json(self) -> dict[str, Any]:
        record = _fields(self)
        for optional in ("alone", "calibrated_by", "level", "threat", "vouches", *OPEN_QUESTIONS, "by_threat"):
            if record[optional] is None:
                del record[optional]
        if self.by_threat is not None:
            record["by_threat"] = [_record(t) for t in self.by_threat]
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> StepVerdict:
        return cls(**_known(cls, record), by_threat=ThreatVerdict.read(record.get("by_threat")))


@dataclass(frozen=True)
class Privacy:
    """A guaranteed setting's privacy beside its attacks: mu, the bound on naming targets, the most any attack
    named (whether a cell beat the bound), what the training's epsilon bounds, and the bound on the PSNR of an
    attacker without a data prior: with the identification bound, the risk corridor."""

    mu: float | None
    mechanism: str
    bound: float | None
    identified: float | None
    identified_by: str
    identified_n: int
    chance: float
    violated: bool
    training_bound: float | None
    #: The prior-free side of the risk corridor (Riess et al. 2024), averaged over the targets: the PSNR an
    #: attacker without a data prior exceeds with probability at most 1 - confidence, and its expected MSE.
    prior_free_psnr: float | None = None
    prior_free_mse: float | None = None
    #: Where a measured attack got past that PSNR (a data prior can): which, and by how much; else "".
    past_prior_free: str = ""
    #: What the framework's own accountant claims beside leakaudit's accounting, then one line per mismatch between
    #: what it was given and what the run did (a Flower DP strategy's accountant); empty where none was read.
    claimed: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorstCase(_Scored):
    """A setting's line in the report: its strongest attack's scores (the leakage metric and its second views)
    and its verdict over the steps. ``attack`` is None where no attack scored a finite value."""

    defense: str
    setting: str
    params: dict[str, Any]
    baseline: bool
    reference: bool
    added: bool
    must_protect: bool
    accuracy: float | None
    epsilon: float | None
    identifiable: float | None
    attack: str | None
    checkpoint: int | None
    scores: dict[str, Scores]
    n: int
    verdict: str | None
    reason: str
    verdict_checkpoint: int | None
    still_improving: bool | None = None
    settling_iterations: int | None = None
    privacy: Privacy | None = None
    worst_image: WorstImage | None = None
    clients: int | None = None  # secure aggregation: how many clients' mean the server saw (the entry's clients:)
    level: str | None = None  # what the verdict says leaks (StepVerdict.level)
    threat: str | None = None  # the attacker it holds against (StepVerdict.threat)
    weak: str | None = None  # StepVerdict.weak of the verdict over the steps
    borderline: str | None = None  # StepVerdict.borderline
    budget: str | None = None  # StepVerdict.budget
    by_threat: list[ThreatVerdict] | None = None  # StepVerdict.by_threat, each threat's worst step

    def to_json(self) -> dict[str, Any]:
        head, tail = self._around_scores("privacy", "worst_image", "clients", "level", "threat", *OPEN_QUESTIONS,
                                         "by_threat")
        means = {m: s.mean for m, s in self.scores.items()}
        cis = {f"{m}_ci": s.ci for m, s in self.scores.items()}
        privacy = _record(self.privacy)
        if privacy is not None and not privacy["claimed"]:  # older summaries read back alike
            del privacy["claimed"]
        return {**head, **means, **cis, **tail, "privacy": privacy,
                "worst_image": _record(self.worst_image) or {},
                **({} if self.clients is None else {"clients": self.clients}),  # older summaries read back alike
                **({} if self.level is None else {"level": self.level}),
                **({} if self.threat is None else {"threat": self.threat}),
                **{k: getattr(self, k) for k in OPEN_QUESTIONS if getattr(self, k) is not None},
                **({} if self.by_threat is None else {"by_threat": [_record(t) for t in self.by_threat]})}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> WorstCase:
        scores = {k[:-3]: Scores(mean=record.get(k[:-3]), ci=v, n=record.get("n", 0))
                  for k, v in record.items() if k.endswith("_ci")}
        privacy = record.get("privacy")
        return cls(**_known(cls, record), scores=scores, worst_image=_image(record.get("worst_image")),
                   privacy=Privacy(**{**privacy, "claimed": tuple(privacy.get("claimed", ()))}) if privacy else None,
                   by_threat=ThreatVerdict.read(record.get("by_threat")))


@dataclass(frozen=True)
class SettingUtility:
    """A setting's utility: test accuracy after its training, the privacy its training spent, what the defense
    changed in the model, and the accuracy of the model attacked at each step."""

    accuracy: float | None
    train_steps: int | None
    epsilon: float | None
    delta: float | None
    model_changes: list[str] | None  # None in a run folder written before it was kept
    checkpoint_accuracy: dict[str, float | None] | None


@dataclass(frozen=True)
class FrontierProbe:
    """One setting a frontier search judged: the knob's value, the setting's name, its verdict and accuracy."""

    value: float
    setting: str
    verdict: str | None
    accuracy: float | None


@dataclass(frozen=True)
class FrontierResult:
    """One ``frontier:`` search: the weakest setting found to protect and the strongest found to leak (its
    bracket), the protecting setting's accuracy with its interval and its margin under the leak threshold (in the
    leakage metric's units), every probe, and why the search stopped."""

    entry: str
    defense: str
    knob: str
    protects: str
    range: list[float]
    tolerance: float
    max_probes: int
    probes: list[FrontierProbe]
    protecting: float | None
    protecting_setting: str | None
    leaking: float | None
    leaking_setting: str | None
    accuracy: float | None
    accuracy_ci: list[float] | None
    margin: float | None
    status: str
    #: The protecting setting attacked again on as many fresh targets (confirmed.json's record: verdict, level,
    #: targets, attack, score, reason); None where the search found none or the run predates confirmation.
    fresh: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> FrontierResult:
        return cls(**{**_known(cls, record), "probes": [FrontierProbe(**p) for p in record["probes"]]})


@dataclass(frozen=True)
class Decision:
    """The audit's answer: the setting that protects at the highest accuracy (``setting``), or, where none does,
    None and the constraint that binds: "privacy" (no setting protects), "utility" (every one that protects is
    unusable), "budget" (the budget cut attacks a full run would use, so a full run could decide otherwise) or
    "judgement" (no verdict could be reached). ``level``: where privacy binds, the least any defended setting
    leaks ("labels": each leaks at least the labels, none need leak individuals)."""

    setting: str | None
    verdict: str | None
    accuracy: float | None
    accuracy_ci: list[float] | None
    binds: str | None
    reason: str
    level: str | None = None


@dataclass(frozen=True)
class NaiveVsAdaptive:
    """At one setting and step, the strongest naive and adaptive attacks' mean leakage and the gap (positive
    where the adaptive attack leaks more: how much safer the defense looks than it is)."""

    defense: str
    setting: str
    checkpoint: int
    metric: str
    accuracy: float | None
    naive_attack: str
    naive_score: float
    adaptive_attack: str
    adaptive_score: float
    gap: float


@dataclass(frozen=True)
class TuningResult:
    """A tuned (setting, attack, step): its search's budget, the untuned and winning scores, and where the
    winner sits on each grid."""

    setting: str
    attack: str
    checkpoint: int
    metric: str
    budget: int
    trials: int
    tuning_batches: int
    untuned: float | None
    tuned: float | None
    winner: dict[str, Any] | str
    on_grid: str
    search_seconds: float


@dataclass
class Summary:
    """What an audit found: per cell the statistics, per setting its worst case and verdict at every step,
    the privacy bounds beside the attacks, and (from the report) the guesses, tuning, figures and provenance."""

    audit: str
    leakage_metric: str
    higher_is_more_leakage: bool
    dataset: str | None
    model: str
    device: str
    seed: int
    metrics: list[str]
    checkpoints: list[int]
    verdict_options: VerdictSection
    leak_threshold: LeakThreshold | None
    chance_accuracy: float | None
    min_accuracy: float | None
    identifiable_by: str | None
    utility: dict[str, SettingUtility]
    cells: list[CellResult]
    worst_case: list[WorstCase]
    verdicts: list[StepVerdict]
    bound_violations: list[str]
    naive_vs_adaptive: list[NaiveVsAdaptive]
    warnings: list[str]
    #: the guesses made without the gradient: guess -> metric -> score (from the report)
    baselines: dict[str, dict[str, float | None]] = field(default_factory=dict)
    tuning: list[TuningResult] = field(default_factory=list)
    #: the architecture analysis's records, as its attacks declare them (from the report)
    architecture: list[dict[str, Any]] = field(default_factory=list)
    #: the run's provenance: versions, device, seeds, wall time (from the report)
    run: dict[str, Any] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    #: each ``frontier:`` search's outcome, and the audit's decision: what to ship, or what binds
    frontier: list[FrontierResult] = field(default_factory=list)
    decision: Decision | None = None
    #: The bar of a leak of labels alone: the better guess that reads nothing of the update, plus the margin
    #: (``leak_threshold`` is then the bar of a leak of individuals, on each target's class mean); None where no
    #: class-aware guess was scored, and left out of summary.json there.
    label_threshold: LeakThreshold | None = None
    version: int = SUMMARY_VERSION

    def cell(self, setting: str, attack: str, checkpoint: int) -> CellResult | None:
        """The cell of one setting, attack and step (None where it did not run)."""
        return next((c for c in self.cells if (c.setting, c.attack, c.checkpoint) == (setting, attack, checkpoint)),
                    None)

    def worst(self, setting: str) -> WorstCase | None:
        """A setting's worst case (None for a setting not in the summary)."""
        return next((w for w in self.worst_case if w.setting == setting), None)

    def to_json(self) -> dict[str, Any]:
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        record.update(verdict_options=dataclasses.asdict(self.verdict_options),
                      leak_threshold=None if self.leak_threshold is None else self.leak_threshold.to_json(),
                      utility={k: _record(u) for k, u in self.utility.items()}, decision=self._decision(),
                      **{k: [x.to_json() if hasattr(x, "to_json") else _record(x) for x in getattr(self, k)]
                         for k in ("cells", "worst_case", "verdicts", "naive_vs_adaptive", "tuning", "frontier")})
        if self.label_threshold is None:
            del record["label_threshold"]
        else:
            record["label_threshold"] = self.label_threshold.to_json()
        return record

    def _decision(self) -> dict[str, Any] | None:
        """The decision as summary.json holds it (its level only where privacy binds on one)."""
        record = _record(self.decision)
        if record is not None and record["level"] is None:
            del record["level"]
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Summary:
        """A summary.json of this release or an earlier one (one with no ``version`` is version 1)."""
        version = record.get("version", 1)
        if version > SUMMARY_VERSION:
            raise ValueError(f"summary.json has layout version {version}; this leakaudit reads up to "
                             f"{SUMMARY_VERSION}: upgrade leakaudit to read it")
        metrics, threshold, labels = record["metrics"], record.get("leak_threshold"), record.get("label_threshold")
        return cls(**{**_known(cls, record), "version": version},
                   label_threshold=LeakThreshold(**{**labels, "missing": tuple(labels.get("missing", ()))})
                   if labels else None,
                   verdict_options=VerdictSection(**_known(VerdictSection, record["verdict_options"])),
                   leak_threshold=LeakThreshold(**{**threshold, "missing": tuple(threshold.get("missing", ()))})
                   if threshold else None,
                   utility={k: SettingUtility(**_known(SettingUtility, u)) for k, u in record["utility"].items()},
                   cells=[CellResult.from_json(c, metrics) for c in record["cells"]],
                   worst_case=[WorstCase.from_json(w) for w in record["worst_case"]],
                   verdicts=[StepVerdict.from_json(v) for v in record["verdicts"]],
                   naive_vs_adaptive=[NaiveVsAdaptive(**n) for n in record.get("naive_vs_adaptive", [])],
                   tuning=[TuningResult(**_known(TuningResult, t)) for t in record.get("tuning", [])],
                   frontier=[FrontierResult.from_json(f) for f in record.get("frontier", [])],
                   decision=Decision(**record["decision"]) if record.get("decision") else None)


def _fields(record, *leave_out: str) -> dict[str, Any]:
    """A record's fields in declaration order, shallow (nested records stay objects), some left out."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name not in leave_out}


def _record(value) -> dict[str, Any] | None:
    """A flat record (or None) as its JSON mapping."""
    return None if value is None else dataclasses.asdict(value)


def _image(record: dict[str, Any] | None) -> WorstImage | None:
    return WorstImage(**record) if record else None


#: Fields that from_json builds itself, beside the ones copied from the record.
_BUILT = {"scores", "worst_image", "privacy", "verdict_options", "leak_threshold", "label_threshold", "utility",
          "cells", "worst_case", "verdicts", "naive_vs_adaptive", "tuning", "version", "frontier", "probes", "decision",
          "by_threat"}


def _known(cls, record: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``record`` that are plain fields of ``cls`` (a key a later layout added is left out)."""
    names = {f.name for f in dataclasses.fields(cls)} - _BUILT
    return {k: v for k, v in record.items() if k in names}
