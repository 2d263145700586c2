"""Judging an audit: confidence intervals, who attacks strongest, and a verdict per setting and checkpoint.

The rule is ``judge`` (leaks, protects, protects but unusable, against the better guess made without the gradient
and the test accuracy a usable model needs) and ``calibrate`` (inconclusive, where the same attacks did not break
the undefended reference); ``rule_text`` states it with an audit's own thresholds for the report, and
docs/verdicts.md explains it. Where a defense guarantees differential privacy, the share of identified images is
held to the bound that guarantee puts on any reconstruction attack (``PrivacyProfile``).
"""
from __future__ import annotations

import math
import dataclasses
from typing import Any, Iterable

import numpy as np

from leakaudit.evaluator.audit.seeds import derive_seed
from leakaudit.evaluator.results.types import (CellResult, LeakThreshold, Scores, StepVerdict, Summary, ThreatVerdict,
                                               WorstCase)
from leakaudit.evaluator.zoo.metrics import CLASS_AWARE
from leakaudit.plugins.attack import MALICIOUS_SERVER
from leakaudit.plugins.components import Metric
from leakaudit.plugins.defense import PrivacyProfile

LEAKS, PROTECTS, UNUSABLE, INCONCLUSIVE = "leaks", "protects", "protects but unusable", "inconclusive"
VERDICTS = (LEAKS, INCONCLUSIVE, UNUSABLE, PROTECTS)  # worst first
#: What a verdict says leaks: the individuals (reconstructions closer than the class-aware guess, or that name
#: their originals among same-class decoys), the labels or class composition alone (closer than the guesses that
#: read nothing of the update, no closer than each target's class mean), or nothing. Worst first.
INDIVIDUALS, PERSONAL, LABELS, NOTHING = "individuals", "personal values", "labels", "nothing"
LEVELS = (INDIVIDUALS, PERSONAL, LABELS, NOTHING)
#: Text: reconstructions leak personal values where they hold more of the targets' names and numbers verbatim
#: than the better guess from the attacker's own sentences, by more than this share.
PII_MARGIN = 0.05
#: An attack is still improving where its loss fell by more than this share of its whole drop in its last fifth.
STILL_IMPROVING = 0.01
#: How much larger a budget a still-improving attack is advised to rerun with.
BUDGET_FACTOR = 2.5


def rule_text(summary: Summary, targets: int, unit: str = "image", chance_of: str = "the majority class's share") -> str:
    """The verdict rule with this audit's own thresholds, as the report states it under its verdicts (the rule
    itself: ``judge`` and ``calibrate``; in prose: docs/verdicts.md); ``unit`` names an example ("image",
    "sentence"), ``chance_of`` what chance accuracy is."""
    o, t = summary.verdict_options, summary.leak_threshold
    beats = (f"beats {t.value:.4g}: the best guess made without the gradient ({t.guess}, {t.guess_score:.4g}) "
             f"{'plus' if summary.higher_is_more_leakage else 'minus'} a margin of {t.margin:.3g}" if t else
             "beats the guesses made without the gradient")
    identifies = "" if o.identifiable is None else (
        f", or when an attack identifies at least {o.identifiable:.0%} of the {unit}s more than their classes explain "
        f"(one {unit} per update: each reconstruction nearest its own original among all targets; several: each original "
        f"named, among up to 8 {unit}s of its class that no update holds, by the reconstruction nearest it, beyond "
        "what the classes alone explain)")
    lt = summary.label_threshold
    levels = "" if lt is None or t is None else (
        f". A leak is of individuals where the bar is each target's class mean from the attacker's data, given its "
        f"label ({t.guess} guess here), or where the {unit}s are identified; one that beats only the guesses that "
        f"read nothing of the update ({lt.value:.4g}: {lt.guess}, {lt.guess_score:.4g}, plus the margin) is a leak "
        "of labels (the classes and class templates), not of individuals")
    usable = "chance plus the margin" if summary.min_accuracy is None else f"{summary.min_accuracy:.3g}"
    chance = "" if summary.chance_accuracy is None else (
        f" (chance: {summary.chance_accuracy:.3g}, {chance_of} of the test split)")
    named = "" if targets < 2 else (
        f' "Identifiable": the share of reconstructions whose nearest original among the audit\'s targets, by '
        f"{summary.identifiable_by}, is their own (a guess scores about 1 in {targets}).")
    return (f"A setting leaks when its strongest attack's {o.statistic.replace('_', ' ')} {beats}{identifies}, at any "
            f"audited step{levels}. Otherwise it protects, or protects but is unusable when its test accuracy stays under "
            f"{usable}{chance}. A \"protects\" is inconclusive where the same attacks, at the same step, budget and "
            "tuning, did not leak on the undefended update either (the reference): they may be too weak to break "
            "anything, so the verdict says nothing until they do (more iterations, a tuned search, another attack). "
            "A reference broken only weakly (originals identified by reconstructions no closer than the guesses that "
            "read nothing of the update) vouches for no \"protects\" of individuals. Where a budget left out, or "
            "scaled down, an attack that runs on a setting, its \"protects\" is inconclusive (budget), unless the "
            "scaled attack still broke the reference at that scale; the decision ships nothing on such a run. A "
            "verdict whose interval straddles a bar, or whose identification is at chance, is marked borderline. "
            "Where a defense changes what is shared (LoRA's adapters, frozen embeddings), only an attack that reads "
            "that kind of update calibrates it; where none ran on it, its \"protects\" is inconclusive. "
            "A verdict whose strongest attack's loss was still falling over the last fifth of its iterations says so, "
            f"with the budget to rerun at. Intervals are percentile bootstrap intervals of the mean over {unit}s "
            f"({o.bootstrap} resamples); with few targets they are wide, and the strongest attack is chosen by its "
            f"mean, which favours an attack that got lucky.{named} Thresholds: the audit's verdict: section.")


def finite(values: Iterable[float | None]) -> list[float]:
    """The values that are numbers (None, NaN and inf left out)."""
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def bootstrap_interval(values: list[float], confidence: float, resamples: int, seed: int) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (Efron & Tibshirani 1993), seeded so a report is reproducible.

    One value gives a zero-width interval: there is nothing to resample, and the report shows n.
    """
    data = np.asarray(values, dtype=float)
    if len(data) < 2:
        return float(data[0]), float(data[0])
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, len(data), size=(resamples, len(data)))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def cell_statistics(values: list[float | None], metric: str, key: tuple, seed: int, confidence: float,
                    resamples: int) -> Scores:
    """Mean, sample standard deviation, bootstrap interval ([low, high]) and count of one cell's per-image scores
    of ``metric`` (the non-finite left out)."""
    vals = finite(values)
    if not vals:
        return Scores()
    mean = float(np.mean(vals))
    std = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
    ci = bootstrap_interval(vals, confidence, resamples, derive_seed(seed, "bootstrap", metric, *map(str, key)))
    return Scores(mean, std, list(ci), len(vals))


def late_gain(trace: Iterable[float]) -> float | None:
    """The share of an attack's whole loss drop made over the last fifth of its iterations (its best loss so
    far): above ``STILL_IMPROVING``, the attack was still improving when its budget ran out. A schedule that
    decays the step size (Inverting Gradients') flattens the last fifth whatever the budget, so a small share
    does not prove convergence: the calibration reference is the check of a budget. None for a trace too short
    to tell (under 10 values)."""
    values = finite(trace)
    if len(values) < 10:
        return None
    best, earlier = min(values), min(values[:len(values) * 4 // 5])
    drop = values[0] - best
    return 0.0 if drop <= 0 else (earlier - best) / drop


def settling_budget(iterations: int | None) -> int | None:
    """The iterations advised to settle a verdict whose attack was still improving (rounded up to a hundred)."""
    return None if not iterations else int(math.ceil(iterations * BUDGET_FACTOR / 100) * 100)


def leak_side(metric: Metric, ci: list[float]) -> float:
    """The end of an interval on the side of more leakage."""
    return ci[1] if metric.higher_is_better else ci[0]


def strongest(cells: list[CellResult], metric: Metric) -> tuple[CellResult, CellResult | None]:
    """The cell whose mean shows the most leakage, and the runner-up (None when alone)."""
    ranked = sorted(cells, key=lambda c: judged_mean(c, metric.name), reverse=metric.higher_is_better)
    return ranked[0], (ranked[1] if len(ranked) > 1 else None)


def judged_mean(record: CellResult | WorstCase, metric: str) -> float:
    """The mean ``metric`` of a cell or worst case being ranked or drawn: only those that scored it are."""
    mean = record.mean(metric)
    assert mean is not None, f"{record.setting}, {record.attack}: no {metric} to rank"
    return mean


def intervals_overlap(a: CellResult, b: CellResult, metric: str) -> bool:
    """Whether two cells' intervals overlap: the ranking of their attacks is then not settled."""
    a_ci, b_ci = a.scores[metric].ci, b.scores[metric].ci
    assert a_ci is not None and b_ci is not None, "a cell with a mean has an interval"
    (a_lo, a_hi), (b_lo, b_hi) = a_ci, b_ci
    return a_lo <= b_hi and b_lo <= a_hi


def leak_threshold(baselines: dict[str, dict[str, float | None]], metric: Metric,
                   margin: float | None, class_aware: bool = True) -> LeakThreshold | None:
    """The score an attack must beat to leak: the better no-gradient guess, plus the margin. None without guesses.
    With ``class_aware`` (the bar of a leak of individuals) the guesses include each target's class mean given its
    label (``CLASS_AWARE``); without it (the bar of a leak of labels) only those that read nothing of the update.
    A guess that scores nothing where the others score (``guess_scores``' mean image, made without the attacker's
    data) is named ``missing``: the bar may stand too low, and ``judge`` does not call a leak on it alone."""
    scored = {name: scores.get(metric.name) for name, scores in baselines.items()
              if class_aware or name not in CLASS_AWARE}
    guesses = {name: v for name, v in scored.items() if v is not None and math.isfinite(v)}
    if not guesses:
        return None
    best = max(guesses, key=guesses.__getitem__) if metric.higher_is_better else min(guesses, key=guesses.__getitem__)
    margin = metric.margin if margin is None else margin
    value = guesses[best] + margin if metric.higher_is_better else guesses[best] - margin
    return LeakThreshold(value, best, guesses[best], margin, tuple(n for n in scored if n not in guesses))


def label_threshold(baselines: dict[str, dict[str, float | None]], metric: Metric,
                    margin: float | None) -> LeakThreshold | None:
    """The bar of a leak of labels (class composition, class templates): the better guess that reads nothing of
    the update, plus the margin; None where it is the leak threshold itself (no class-aware guess was scored), so
    that every leak is one of individuals, as before the class-aware guess."""
    bar = leak_threshold(baselines, metric, margin, class_aware=False)
    full = leak_threshold(baselines, metric, margin)
    return None if bar is None or full is None or full.guess not in CLASS_AWARE else bar


def min_accuracy(options: dict[str, Any], chance: float | None, undefended: float | None = None,
                 max_drop: float | None = None) -> float | None:
    """The test accuracy a usable model needs: ``min_accuracy``; else chance plus ``utility_margin``, raised to
    the ``undefended`` model's accuracy less ``max_drop`` where both are known (a defense that costs more than a
    team accepts is unusable, however far above chance)."""
    if options.get("min_accuracy") is not None:
        return options["min_accuracy"]
    floor = None if chance is None else chance + options["utility_margin"]
    if undefended is None or max_drop is None:
        return floor
    return max(undefended - max_drop, floor if floor is not None else 0.0)


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def judge(cells: list[CellResult], metric: Metric, threshold: LeakThreshold | None, accuracy: float | None,
          needed: float | None, chance: float | None, options: dict[str, Any],
          labels_bar: LeakThreshold | None = None) -> StepVerdict:
    """The verdict for one setting at one checkpoint, from the cells of every attack run there, and what it says
    leaks (``level``): the individuals where the strongest attack beats ``threshold`` (the class-aware guess the
    best) or an attack identifies its originals; the labels alone where it beats only ``labels_bar`` (the guesses
    that read nothing of the update); else nothing."""
    name = metric.name
    top, runner_up = strongest(cells, metric)
    scores, statistic = top.scores[name], options["statistic"]
    assert scores.mean is not None and scores.ci is not None, "judged cells scored the metric"
    if statistic == "mean":
        value, what = scores.mean, "mean"
    else:
        value, what = leak_side(metric, scores.ci), f"{options['confidence']:.0%} bound"
    lo, hi = scores.ci
    evidence = (f"{top.attack} reaches {name} {_fmt(scores.mean)} "
                f"({options['confidence']:.0%} CI {_fmt(lo)} to {_fmt(hi)}, n={scores.n})")
    if runner_up is not None and intervals_overlap(top, runner_up, name):
        evidence += f"; {runner_up.attack} is close behind (the intervals overlap)"
    if top.identifiable is not None and top.identifiable_n and options.get("batch_size", 1) == 1:
        evidence += (f"; {top.identifiable:.0%} of its reconstructions are nearest their own original "
                     f"(a guess: about {1 / top.identifiable_n:.0%}"
                     + ("" if top.decoy_p is None else f"; p = {top.decoy_p:.2g} for one that knows the classes") + ")")
    elif top.decoy_hits is not None:
        evidence += (f"; it names {top.decoy_hits} of its {top.identifiable_n} originals among decoys of their "
                     f"classes (p = {top.decoy_p:.2g})")
    if top.own_coordinates is not None:
        evidence += f"; {own_coordinates_words(top.own_coordinates, top.defense, options.get('unit', 'image'))}"
    out = dict(setting=top.setting, defense=top.defense, checkpoint=top.checkpoint, attack=top.attack,
               score=scores.mean, ci=scores.ci, statistic=statistic, compared=value,
               threshold=None if threshold is None else threshold.value, accuracy=accuracy, min_accuracy=needed,
               still_improving=top.still_improving,
               settling_iterations=settling_budget(top.iterations) if top.still_improving else None)
    identifier, named = identified(cells, name, options)
    if threshold is None:
        if named is not None:
            return StepVerdict(**out, verdict=LEAKS, level=INDIVIDUALS, reason=f"{evidence}; {named}")
        return StepVerdict(**out, verdict=None, reason=f"not judged: no guess without the gradient scores {name}")
    beats = metric.better(value, threshold.value)
    bar = _bar(threshold, metric)
    doubt = _borderline(metric, top, ((threshold, "the leak threshold"), (labels_bar, "the bar of a leak of labels")),
                        options)
    if beats and threshold.missing and named is None:
        return StepVerdict(**out, verdict=INCONCLUSIVE, alone=LEAKS, reason=(
            f"{evidence}; its {what} beats the leak threshold {bar}, but the {' and '.join(threshold.missing)} "
            f"guess{'es' * (len(threshold.missing) > 1)} could not be made (the attacker holds no data besides the attacked batch), so the bar stands on "
            f"the other guesses alone ({threshold.guess} the best) and a reconstruction no closer than the data's "
            "mean image would pass it; give the attacker data of its own (a monitor's prior=) to settle it"))
    if beats:
        at_chance = None if named is not None else _identified_at_chance(top, options)
        return StepVerdict(**out, verdict=LEAKS, level=INDIVIDUALS, borderline=_joined(doubt, at_chance),
                           reason=f"{evidence}; its {what} beats the leak threshold {bar}")
    if named is not None:
        assert identifier is not None, "an identification names its attack"
        weak, vouches = _weak(metric, identifier, value, threshold, labels_bar, options, what)
        return StepVerdict(**out, verdict=LEAKS, level=INDIVIDUALS, weak=weak, vouches=vouches, borderline=doubt,
                           reason=f"{evidence}; its {what} does not beat the leak threshold {bar}, but {named}"
                                  + (f"; a weak break: {weak}" if weak else ""))
    personal = _personal_values(cells, options, name)
    if personal is not None:
        return StepVerdict(**out, verdict=LEAKS, level=PERSONAL, reason=(
            f"{evidence}; its {what} does not beat the leak threshold {bar}, but {personal}"))
    if labels_bar is not None and metric.better(value, labels_bar.value):
        return StepVerdict(**out, verdict=LEAKS, level=LABELS, borderline=doubt, reason=(
            f"{evidence}; its {what} beats the bar of the guesses that read nothing of the update, "
            f"{_bar(labels_bar, metric)}, but not the leak threshold of individuals, {bar}: each target's class "
            "mean given its label; and no attack names its originals among decoys of their classes: it shows the "
            "labels and class composition (class templates), not the individuals"))
    reason = f"{evidence}; its {what} does not beat the leak threshold {bar}"
    if accuracy is not None and needed is not None and accuracy < needed:
        undefended = options.get("undefended")
        if options.get("min_accuracy") is not None:
            base = "min_accuracy"
        elif undefended is not None and needed == undefended - options["max_drop"]:
            base = f"the undefended model's {undefended:.3f} - max_drop {_fmt(options['max_drop'])}"
        else:
            assert chance is not None, "needed is chance plus utility_margin here"
            base = f"chance {_fmt(chance)} + {_fmt(options['utility_margin'])}"
        return StepVerdict(**out, verdict=UNUSABLE, level=NOTHING, borderline=doubt,
                           reason=f"{reason}{_still_improving(top)}; but test accuracy "
                                                           f"{accuracy:.3f} is under {needed:.3f} ({base})")
    reason += _still_improving(top)
    if accuracy is None:
        reason += f"; utility not measured ({options.get('no_utility', 'utility.train_steps is 0')})"
    elif needed is None:
        reason += "; utility not judged (chance accuracy unknown for this run)"
    else:
        reason += f"; test accuracy {accuracy:.3f} is at least {needed:.3f}"
    if options.get("labels_granted"):
        reason += "; nothing beyond what the threat model grants (the labels are given to the attacker)"
    return StepVerdict(**out, verdict=PROTECTS, level=NOTHING, borderline=doubt, reason=reason)


def own_coordinates_words(counts: list[int], defense: str, unit: str = "image") -> str:
    """How a cell's updates were read under per-element secure aggregation (``counts``: per update, the coordinates
    the first client alone sent): as that client's own sparse update, or, where none had one contributor, whole."""
    read = [n for n in counts if n]
    each = f"{read[0]:,}" if len(read) == 1 else (f"{min(read):,}" if min(read) == max(read) else
                                                  f"{min(read):,} to {max(read):,}") if read else ""
    own = (f"read as client 1's own {defense} update, its reconstruction scored against client 1's {unit}s alone "
           "(per-element secure aggregation)")
    if len(read) == len(counts):
        where = "" if len(counts) == 1 else f"in each of its {len(counts)} updates "
        return f"{where}{each} coordinates had one contributor: {own}"
    whole = f"the aggregate attacked as a whole, every client's {unit}s scored"
    if not read:
        where = "in its update" if len(counts) == 1 else f"in any of its {len(counts)} updates"
        return f"no coordinate had one contributor {where}: {whole}"
    return (f"in {len(read)} of its {len(counts)} updates {each} coordinates had one contributor: {own}; in the "
            f"other {len(counts) - len(read)} none had one: {whole}")


def _borderline(metric: Metric, top: CellResult, bars: tuple[tuple[LeakThreshold | None, str], ...],
                options: dict[str, Any]) -> str | None:
    """Why the strongest attack's interval leaves the verdict's level open: it straddles a bar between levels
    (None where it clears them all)."""
    lo, hi = top.scores[metric.name].ci or (None, None)
    if lo is None or hi is None:
        return None
    for bar, what in bars:
        if bar is not None and lo < bar.value < hi:
            return (f"its {options['confidence']:.0%} interval, {_fmt(lo)} to {_fmt(hi)}, straddles {what} "
                    f"{_fmt(bar.value)}")
    return None


def _identified_at_chance(top: CellResult, options: dict[str, Any]) -> str | None:
    """Why a leak of individuals on the mean alone is borderline: the strongest attack's reconstructions name their
    originals no better than chance (one image per update: no more than 1 in N; batches: p at least 0.5 under the
    null that they know only the classes); None where they do, or where it was not measured."""
    n = top.identifiable_n
    if options.get("batch_size", 1) == 1:
        share = top.identifiable
        if share is None or n < 2 or math.isnan(share) or (
                share > 1 / n if top.decoy_p is None else top.decoy_p < 0.5):
            return None
        return f"its identification is at chance ({share:.0%} nearest their own original; a guess: about {1 / n:.0%})"
    if top.decoy_p is None or top.decoy_p < 0.5:
        return None
    return (f"its identification is at chance ({top.decoy_hits} of {n} originals named among decoys of their "
            f"classes, p = {top.decoy_p:.2g})")


def _weak(metric: Metric, identifier: CellResult, top_value: float, threshold: LeakThreshold,
          labels_bar: LeakThreshold | None, options: dict[str, Any], what: str) -> tuple[str | None, str | None]:
    """Whether a leak of individuals through identification alone is weak, and then the level it vouches for as a
    reference: weak where the identifying attack's reconstructions are no closer than the guesses that read nothing
    of the update (the bar of a leak of labels; the leak threshold where no labels are to be leaked), so that it
    vouches for the labels where the strongest attack beats their bar, else for nothing. (None, None): strong."""
    bar = labels_bar or threshold
    scores = identifier.scores[metric.name]
    assert scores.mean is not None and scores.ci is not None, "judged cells scored the metric"
    own = scores.mean if options["statistic"] == "mean" else leak_side(metric, scores.ci)
    if metric.better(own, bar.value):
        return None, None
    words = (f"{identifier.attack} names its originals, but its {what} {_fmt(own)} does not beat the guesses that "
             f"read nothing of the update ({_bar(bar, metric)}), so it vouches for no \"protects\" of individuals")
    return words, LABELS if labels_bar is not None and metric.better(top_value, labels_bar.value) else NOTHING


def _joined(*parts: str | None) -> str | None:
    """The parts that are said, joined by semicolons (None where none is)."""
    said = [p for p in parts if p]
    return "; ".join(said) if said else None


def _personal_values(cells: list[CellResult], options: dict[str, Any], metric: str) -> str | None:
    """Why some attack's reconstructions recover personal values beyond a guess (None where none does, or where
    no guess scored them): the most any attack holds verbatim of the targets' names and numbers exceeds what the
    better guess from the attacker's own sentences holds (``pii_guess``) by more than ``PII_MARGIN``."""
    guess = options.get("pii_guess")
    scored = [(c.pii_recall, c) for c in cells if c.pii_recall is not None]
    if guess is None or not scored:
        return None
    recall, top = max(scored, key=lambda p: p[0])
    if recall <= guess + PII_MARGIN:
        return None
    return (f"{top.attack}'s reconstructions hold {recall:.0%} of the targets' personal values verbatim "
            f"(names, numbers), where a guess from the attacker's own sentences holds {guess:.0%}: beyond it by more "
            f"than the {PII_MARGIN:.0%} margin, personal values leak whatever the {metric}")


def _bar(threshold: LeakThreshold, metric: Metric) -> str:
    """A leak threshold in words: its value, the guess it stands on and the margin."""
    return (f"{_fmt(threshold.value)} ({threshold.guess} guess {_fmt(threshold.guess_score)} "
            f"{'+' if metric.higher_is_better else '-'} margin {_fmt(threshold.margin)})")


def _still_improving(top: CellResult) -> str:
    """The words of a verdict whose strongest attack was still improving when its budget ran out ("" if not)."""
    if not top.still_improving:
        return ""
    budget = settling_budget(top.iterations)
    advice = f"rerun with iterations: {budget} to settle it" if budget else "rerun with a larger budget to settle it"
    return (f"; {top.attack} was still improving when its budget ran out (its loss fell {top.late_gain:.0%} "
            f"of its whole drop over its last fifth): {advice}")


def calibrate(verdict: StepVerdict, reference: StepVerdict | None, untried: str = "", unread: str = "") -> StepVerdict:
    """A step's verdict held against the verdict of its model's undefended reference at the same step: a
    "protects" (or "protects but unusable") is inconclusive where the same attacks did not break even the
    undefended update, since it cannot be told from an attack too weak to break anything; where they did, the
    attack that broke it is named (``calibrated_by``). ``untried``: stronger attack classes the audit did not run,
    for the advice. ``unread``: why no attack run on the setting reads the kind of update its defense shares
    (LoRA's adapters): then it is inconclusive whatever the reference."""
    if verdict.verdict not in (PROTECTS, UNUSABLE):
        return verdict
    if unread:
        return dataclasses.replace(verdict, verdict=INCONCLUSIVE, alone=verdict.verdict, level=None, reason=(
            f"{unread}. Judged alone: {verdict.verdict}: {verdict.reason}"))
    fix = ("to settle it: more iterations, a tuned search (tune:) or a stronger attack, until the undefended update "
           "leaks" + (f"; attacks of a stronger class this audit did not run: {untried}" if untried else ""))
    vouched = vouched_level(reference)
    weakly = "" if reference is None or not reference.weak else (
        f" (it breaks it at the level of individuals only weakly: {reference.weak})")
    if vouched == LABELS:
        # the attacks reach only the undefended update's classes: a "protects" stands for the labels alone
        assert reference is not None, "a level is vouched for by a reference"
        return dataclasses.replace(verdict, verdict=INCONCLUSIVE, alone=verdict.verdict, level=None, reason=(
            f"protects labels, calibrated by {reference.attack}, which reaches the labels of the undefended update at "
            f"this step ({reference.setting}: {_fmt(reference.score)}){weakly}; but no attack broke the undefended "
            "update at the level of individuals with a margin (no reconstruction closer than each target's class "
            "mean, none named among decoys of its class by reconstructions closer than the guesses), so whether it "
            "protects individuals is inconclusive; to settle it: more iterations, a tuned search (tune:) or a "
            "stronger attack, until the undefended update leaks individuals"
            + (f"; attacks of a stronger class this audit did not run: {untried}" if untried else "")
            + f". Judged alone: {verdict.verdict}: {verdict.reason}"))
    if vouched is not None and vouched != NOTHING:
        assert reference is not None, "a level is vouched for by a reference"
        if reference.setting == verdict.setting:
            return verdict
        return dataclasses.replace(verdict, calibrated_by=reference.attack, reason=(
            f"{verdict.reason}; calibrated by {reference.attack}, which breaks the undefended update at this step "
            f"at the level of {vouched} ({reference.setting}: {_fmt(reference.score)})"))
    if reference is not None and reference.weak:
        return dataclasses.replace(verdict, verdict=INCONCLUSIVE, alone=verdict.verdict, level=None, reason=(
            f"the attacks broke the undefended update at this step only weakly ({reference.setting}: "
            f"{reference.weak}); {fix}. Judged alone: {verdict.verdict}: {verdict.reason}"))
    if reference is None:
        why = "no attack ran on the undefended update at this step, so the attacks' strength is unknown"
    elif reference.setting == verdict.setting:
        why = "the attacks did not break even this undefended update at this budget"
    else:
        why = (f"the attacks did not break even the undefended update at this budget (reference "
               f"{reference.setting}: {reference.attack} reaches {_fmt(reference.score)}"
               + ("" if reference.threshold is None else f", the leak threshold is {_fmt(reference.threshold)}")
               + ")")
    return dataclasses.replace(verdict, verdict=INCONCLUSIVE, alone=verdict.verdict, level=None,
                               reason=f"{why}; {fix}. Judged alone: {verdict.verdict}: {verdict.reason}")


def vouched_level(reference: StepVerdict | None) -> str | None:
    """The level at which a reference's verdict vouches for a "protects" of the settings it calibrates: the level it
    leaks at, or for a weak break (identification by reconstructions no closer than the guesses) the labels or
    nothing; None where it does not leak."""
    if reference is None or reference.verdict != LEAKS:
        return None
    return reference.vouches or reference.level or INDIVIDUALS


def identified(cells: list[CellResult], metric: str,
               options: dict[str, Any]) -> tuple[CellResult | None, str | None]:
    """The cell of the attack whose reconstructions identify their originals, and why ((None, None) when none
    does): some attack's share of reconstructions nearest their own original reaches ``identifiable`` and
    beats the 1-in-N chance of a guess (one-sided binomial test at the verdict's confidence)."""
    if options.get("identifiable") is None:
        return None, None
    if options.get("batch_size", 1) > 1:
        return _named_among_decoys(cells, options)
    for c in sorted(cells, key=lambda c: -(c.identifiable or 0)):
        share, n = c.identifiable, c.identifiable_n or 0
        if share is None or n < 2 or math.isnan(share):
            continue
        if share < options["identifiable"]:
            return None, None  # the cells are in decreasing share: none of the rest reaches it either
        hits = round(share * n)
        # against a guess that knows the classes where the run measured it, else 1 in N
        p, guess = ((c.decoy_p, "a guess that knows the classes") if c.decoy_p is not None
                    else (_binomial_p(hits, n, 1 / n), f"a guess: 1 in {n}"))
        if p < 1 - options["confidence"]:
            return c, (f"{c.attack} identifies {hits} of {n} {options.get('unit', 'image')}s (each reconstruction "
                       f"nearest its own original; {guess}, p = {p:.2g}), at least the {options['identifiable']:.0%} "
                       "the verdict allows")
    return None, None


def _named_among_decoys(cells: list[CellResult], options: dict[str, Any]) -> tuple[CellResult | None, str | None]:
    """``identified`` for batches: some attack names at least ``identifiable`` of the originals among same-class
    decoys, beyond what the batch's classes explain (``decoy_test`` at the verdict's confidence)."""
    for c in sorted(cells, key=lambda c: -(c.decoy_hits or 0)):
        if c.decoy_hits is None or c.decoy_p is None or not c.identifiable_n:
            continue
        if c.decoy_hits / c.identifiable_n < options["identifiable"]:
            return None, None  # in decreasing hits: none of the rest reaches it either
        if c.decoy_p < 1 - options["confidence"]:
            return c, (f"{c.attack} names {c.decoy_hits} of {c.identifiable_n} originals among up to "
                    f"{DECOYS_PER_IMAGE} decoys of each one's class (nearest of its update's images and their decoys; "
                    f"p = {c.decoy_p:.2g} where the reconstructions know only the classes), at least the "
                    f"{options['identifiable']:.0%} the verdict allows")
    return None, None


def beats_bound(share: float | None, n: int, bound: float | None, confidence: float,
                unit: str = "image") -> str | None:
    """Why a measured identification rate is above what a privacy guarantee allows any attack (one-sided
    binomial test against the bound at the verdict's confidence), or None where it is not, or cannot be told."""
    if share is None or bound is None or n < 2 or math.isnan(share) or bound >= 1:
        return None
    hits = round(share * n)
    p = _binomial_p(hits, n, bound)
    if p >= 1 - confidence:
        return None
    return (f"identifies {hits} of {n} {unit}s where the defense's privacy guarantee allows any attack at most "
            f"{bound:.1%} (binomial p = {p:.2g}): the defense sends less noise than it declares, or its accounting "
            "is wrong")


def exact_interval(hits, n, tail: float) -> tuple[np.ndarray, np.ndarray]:
    """Clopper-Pearson ends of ``hits`` out of ``n`` (numbers or arrays), each with probability ``tail`` beyond it
    (scipy, imported on use)."""
    from scipy.stats import beta

    hits, n = np.asarray(hits), np.asarray(n)
    low = np.where(hits == 0, 0.0, beta.ppf(tail, np.maximum(hits, 1), n - hits + 1))
    high = np.where(hits == n, 1.0, beta.ppf(1 - tail, hits + 1, np.maximum(n - hits, 1)))
    return low, high


def _binomial_p(hits: int, n: int, rate: float) -> float:
    """One-sided binomial test: the chance of ``hits`` or more of ``n`` at ``rate`` (scipy, imported on use)."""
    from scipy.stats import binomtest

    return float(binomtest(hits, n, rate, alternative="greater").pvalue)


def training_bound(epsilon: float | None, delta: float | None, kappa: float) -> float | None:
    """The bound (epsilon, delta)-DP of the whole training sets on identifying a target where a guess succeeds
    with probability ``kappa`` (``e^epsilon kappa + delta``, Balle et al. 2022): what an attacker of every round
    faces, not knowing when the target was sampled; None without an epsilon."""
    if epsilon is None or delta is None or not 0 < kappa < 1 or not math.isfinite(epsilon):
        return None
    return PrivacyProfile(pairs=((epsilon, delta),)).reconstruction_bound(kappa)


def identification_bound(profile: PrivacyProfile | None, batch: int, n: int) -> float | None:
    """The most any attack can name of ``n`` targets sent in updates of ``batch`` under one update's ``profile``
    (a guess names ``kappa = batch / n``); None without a guarantee, or where every target is in one update."""
    return None if profile is None or n <= batch else profile.reconstruction_bound(batch / n)


def prior_free_bound(mu: float | None, pixels: np.ndarray, confidence: float) -> dict[str, float] | None:
    """What an attacker without a data prior can reach on these images (pixels in [0, 1], one image per row of
    ``pixels``) from one ``mu``-GDP update (Riess et al. 2024): its best reconstruction is the image plus
    N(0, ||x||^2 / mu^2) noise per pixel, so its MSE is (||x||^2 / (mu^2 N)) chi^2_N. Returns, averaged over the
    images, the expected MSE (``mse``, its floor on average) and the PSNR it exceeds with probability at most
    ``1 - confidence`` (``psnr``, its ceiling); None without a mu."""
    from scipy.special import gammaincinv

    if mu is None or not mu > 0 or math.isinf(mu):
        return None
    flat = pixels.reshape(len(pixels), -1).astype(np.float64)
    n = flat.shape[1]
    spread = (flat ** 2).sum(axis=1) / mu ** 2  # ||x||^2 / mu^2: each pixel's noise variance
    lucky_mse = spread * 2 * gammaincinv(n / 2, 1 - confidence) / n  # the (1 - confidence) quantile of the MSE
    return {"mse": float(spread.mean()), "psnr": float(np.mean(-10 * np.log10(lucky_mse)))}


def overall(verdicts: list[StepVerdict]) -> StepVerdict | None:
    """A setting's verdict over its checkpoints: the worst one (a leak at any step is a leak)."""
    judged = [v for v in verdicts if v.verdict is not None]
    if not judged:
        return verdicts[0] if verdicts else None
    return min(judged, key=lambda v: (VERDICTS.index(v.verdict), LEVELS.index(v.level) if v.level in LEVELS else 0))


def identifiable_share(distances: np.ndarray) -> float:
    """Share of reconstructions (rows) whose nearest original (columns) is their own (the diagonal).

    Ties count against identification, so a constant guess scores 0 rather than 1/N.
    """
    own = np.diag(distances)
    others = distances + np.diag(np.full(len(distances), np.inf))
    return float(np.mean(own < others.min(axis=1))) if len(distances) > 1 else float("nan")


def named_share(distances: np.ndarray, batch: int) -> float | None:
    """Share of the targets that an attacker names from its reconstructions alone, with no matching to the
    truth first: each reconstruction's nearest original among all targets (rows: reconstructions, columns:
    originals, in updates of ``batch`` consecutive images), counted once where it is an image of its own update
    and nearer than every other update's. A guess names ``batch`` of N, so it scores ``batch / N``: the prior
    success a privacy bound is computed from. One image per update: ``identifiable_share``. None where every
    target is in one update (a guess names them all)."""
    n = len(distances)
    if n <= batch:
        return None
    hits = 0
    for start in range(0, n, batch):
        own = np.zeros(n, dtype=bool)
        own[start:start + batch] = True
        rows = distances[start:start + batch]
        inside, outside = np.where(own, rows, np.inf), np.where(own, np.inf, rows)
        named = inside.argmin(axis=1)[inside.min(axis=1) < outside.min(axis=1)]
        hits += len(set(named.tolist()))
    return hits / n


#: Decoys of the same class as each original, for the identification test of a batch (``decoy_test``).
DECOYS_PER_IMAGE = 8


def decoy_groups(labels: np.ndarray, decoy_labels: np.ndarray) -> list[list[int]]:
    """For each original of one update (``labels``), the indices of up to ``DECOYS_PER_IMAGE`` decoys of its
    class, in the decoys' order, none given to two originals."""
    groups, taken = [], set()
    for label in labels.tolist():
        mine = [d for d in np.flatnonzero(decoy_labels == label).tolist() if d not in taken][:DECOYS_PER_IMAGE]
        taken.update(mine)
        groups.append(mine)
    return groups


def decoy_test(own: list[np.ndarray], decoys: list[np.ndarray], groups: list[list[list[int]]]) -> tuple[int, int, float]:
    """Whether a batch's reconstructions name their own update's originals beyond what their classes explain:
    per update, the distances (rows: reconstructions) to its originals (``own``) and to the decoys (``decoys``),
    and each original's group of same-class decoys (``groups``). Each reconstruction names its nearest image
    among the originals and their decoys; a hit is an original named by at least one.

    Under the null that a reconstruction depends on its update's images only through their classes, each
    original is exchangeable with its decoys, so an original is named with the share of its group (itself and
    its decoys) that is named: the hits are a sum of independent Bernoulli draws, and the p-value is their
    exact upper tail (Poisson binomial). Returns (hits, originals, p-value)."""
    hits, chances = 0, []
    for d_own, d_decoys, members in zip(own, decoys, groups):
        b = d_own.shape[1]
        pool = np.concatenate([d_own, d_decoys], axis=1)
        named = set(pool.argmin(axis=1).tolist())
        hits += sum(1 for i in range(b) if i in named)
        for i, mine in enumerate(members):
            chances.append(sum(1 for m in [i, *(b + d for d in mine)] if m in named) / (1 + len(mine)))
    return hits, len(chances), poisson_binomial_tail(chances, hits)


def class_aware_test(distances: np.ndarray, labels: np.ndarray) -> tuple[int, int, float]:
    """``decoy_test`` for one image per update, among the audit's targets: whether reconstructions (rows) are
    nearest their own original (the diagonal) among all targets beyond what their classes explain. Under the null
    that a reconstruction depends on its original only through its class (a class template, which the labels an
    update shows or a threat model grants give away), the original is exchangeable with the other targets of its
    class, so it is the nearest with probability at most one over their count. Returns (hits, targets, p-value)."""
    others = distances + np.diag(np.full(len(distances), np.inf))
    hits = int((np.diag(distances) < others.min(axis=1)).sum())
    chances = [1 / int((labels == label).sum()) for label in labels.tolist()]
    return hits, len(chances), poisson_binomial_tail(chances, hits)


def poisson_binomial_tail(chances: list[float], hits: int) -> float:
    """The chance of ``hits`` or more successes of independent draws that succeed with ``chances``: the exact upper
    tail of the Poisson binomial distribution, built one draw at a time."""
    tail = np.zeros(len(chances) + 1)
    tail[0] = 1.0
    for q in chances:
        tail[1:] = tail[1:] * (1 - q) + tail[:-1] * q
        tail[0] *= 1 - q
    return float(min(1.0, tail[hits:].sum()))


#: What ``--fail-on-leak`` fails on: each level, with the levels it takes in (individuals: their personal values
#: too; labels: every leak).
GATE_LEVELS = {INDIVIDUALS: (INDIVIDUALS, PERSONAL), LABELS: (INDIVIDUALS, PERSONAL, LABELS)}


def gate_failures(summary: Summary, allow_inconclusive: bool = False,
                  settings: Iterable[str] | None = None, fail_on: str = INDIVIDUALS) -> list[tuple[str, str]]:
    """``(kind, line)`` for each reason the gate fails: a checked setting (those marked ``must_protect``, or the
    ``settings`` named) that fails ``gate_reading`` at ``fail_on`` ("leak", "unjudged", "inconclusive" unless
    allowed), and any setting whose attacks beat the bound its privacy guarantee puts on them ("bound": the defense
    or its accounting is wrong). The gate fails closed: a setting it cannot vouch for is not passed."""
    named = None if settings is None else set(settings)
    lines = []
    for w in summary.worst_case:
        checked = w.must_protect if named is None else w.setting in named
        if not checked:
            continue
        where = f"{w.setting} (must_protect)" if named is None else w.setting
        reading = gate_reading(w, fail_on)
        if reading is None or (reading[0] == INCONCLUSIVE and allow_inconclusive):
            continue
        lines.append((reading[0], f"{where} {reading[1]}"))
    lines += [("bound", line) for line in summary.bound_violations]
    return lines


def kinder_than(a: WorstCase | StepVerdict, b: WorstCase | StepVerdict) -> bool:
    """Whether verdict ``a`` passes the gate at some level where ``b`` of the same setting fails it: what a run cut
    short (a budget, settling) must never be against a fuller run of the same file. Moving toward inconclusive is
    never kinder (the gate fails an inconclusive setting)."""
    return any(gate_reading(a, level) is None and gate_reading(b, level) is not None for level in GATE_LEVELS)


def gate_reading(w: WorstCase | StepVerdict, fail_on: str = INDIVIDUALS) -> tuple[str, str] | None:
    """The one level rule that the gate (``--fail-on-leak``, ``assert_protects``) and the decision read: None where
    a setting passes at ``fail_on``, else ``(kind, words)``: "leak" where it leaks at a level ``fail_on`` takes in
    (``GATE_LEVELS``; a leak of an older summary, which names no level, counts as one of individuals); "unjudged";
    "inconclusive" where it is, or where it leaks a lesser level that a run with the attacks the budget cut could
    find to be one ``fail_on`` takes in."""
    level = w.level or INDIVIDUALS
    step = w.checkpoint if isinstance(w, StepVerdict) else w.verdict_checkpoint
    if w.verdict == LEAKS and level in GATE_LEVELS[fail_on]:
        return "leak", f"leaks {level} at step {step}: {w.reason}"
    if w.verdict == LEAKS and w.budget:
        return INCONCLUSIVE, f"leaks {level} at step {step}, and whether it leaks {fail_on} is inconclusive: {w.budget}"
    if w.verdict is None:
        return "unjudged", f"could not be judged: {w.reason}"
    if w.verdict == INCONCLUSIVE:
        return INCONCLUSIVE, f"is inconclusive at step {step}: {w.reason}"
    return None


def verdict_words(w: WorstCase | StepVerdict) -> str:
    """A verdict as the terminal and the report name it: the verdict, what leaks, and whether it is borderline, weak
    or left open by the budget."""
    marks = [mark for mark, words in (("weak", w.weak), ("borderline", w.borderline), ("budget", w.budget)) if words]
    return _said(w) + (f" ({', '.join(marks)})" if marks else "")


def _said(w: WorstCase | StepVerdict | ThreatVerdict) -> str:
    """The verdict and, for a leak, what leaks."""
    return (w.verdict or "not judged") + (f" {w.level}" if w.verdict == LEAKS and w.level else "")


def open_questions(w: WorstCase | StepVerdict) -> list[tuple[str, str]]:
    """What a verdict leaves open, one (label, words) per line under its why-line, as the terminal and the report
    print them: borderline; budget, where the reason does not already say it."""
    return [(label, words) for label, words in (("borderline", w.borderline), ("budget", w.budget))
            if words and words not in w.reason]


def threat_text(w: WorstCase | StepVerdict) -> str:
    """The verdict under each threat model its attacks span, weakest attacker first, as one line ("" where they
    span one)."""
    return "; ".join(f"{t.threat}: {_said(t)} ({t.attack}, step {t.checkpoint})" for t in w.by_threat or ())


def passive_words(by_threat: list[ThreatVerdict] | None) -> str | None:
    """Where no passive attacker reaches individuals but a malicious server does, the words that say both: a
    "protects" against the passive attacks is never said without the attacker that breaks it."""
    passive = [t for t in by_threat or () if t.threat != MALICIOUS_SERVER]
    malicious = [t for t in by_threat or () if t.threat == MALICIOUS_SERVER]
    if not passive or not malicious or _reaches(passive[-1]) or not _reaches(malicious[0]):
        return None
    top = passive[-1]
    short = {LEAKS: f", which reach its {top.level}", INCONCLUSIVE: ", inconclusive: they break no undefended update "
             "to vouch for it"}.get(top.verdict or "", "")
    return (f"protects individuals against the named passive attacks ({', '.join(top.attacks)}{short}); a malicious "
            f"server reaches them ({malicious[0].attack}, step {malicious[0].checkpoint})")


def _reaches(t: ThreatVerdict) -> bool:
    """Whether a threat model's verdict reaches individuals (a leak the default gate fails)."""
    return t.verdict == LEAKS and (t.level or INDIVIDUALS) in GATE_LEVELS[INDIVIDUALS]
