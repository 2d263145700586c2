"""summary.json from a run's rows: per cell the statistics and intervals, per setting its worst case and
verdicts (calibrated against the undefended reference), the privacy bounds, naive against adaptive, tuning."""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from statistics import NormalDist
from typing import Any, Sequence

import numpy as np

from leakaudit.evaluator.audit.tuning import grid_positions, position, scan_best, value_at, winners
from leakaudit.evaluator.audit.frontier import PROTECTING, search
from leakaudit.evaluator.audit.checks import example_unit
from leakaudit.evaluator.audit.types import Audit, FrontierSpec, as_dict
from leakaudit.evaluator.results.rows import Row
from leakaudit.evaluator.results.types import (
    CellResult,
    Decision,
    FrontierProbe,
    FrontierResult,
    LeakThreshold,
    NaiveVsAdaptive,
    Privacy,
    Scores,
    SettingUtility,
    StepVerdict,
    Summary,
    ThreatVerdict,
    TuningResult,
    WorstCase,
    WorstImage,
)
from leakaudit.evaluator.audit.budget import cuts_anything, duration_text, full_budget
from leakaudit.evaluator.results.verdict import (
    GATE_LEVELS,
    INCONCLUSIVE,
    INDIVIDUALS,
    LEAKS,
    LEVELS,
    PROTECTS,
    UNUSABLE,
    STILL_IMPROVING,
    beats_bound,
    calibrate,
    cell_statistics,
    gate_reading,
    finite,
    identification_bound,
    judge,
    judged_mean,
    label_threshold,
    leak_threshold,
    min_accuracy,
    overall,
    passive_words,
    strongest,
    training_bound,
    vouched_level,
)
from leakaudit.plugins.attack import ATTACKERS
from leakaudit.plugins.components import Metric
from leakaudit.plugins.defense import FULL, UPDATE_KINDS
from leakaudit.plugins.manager import Registry


def ranked_metrics(registry: Registry, rank: str) -> list[Metric]:
    """The registered metrics that declare ``rank`` (``view_rank``, ``distance_rank``), lowest rank first."""
    declared = [m for m in (registry.get("metric", n) for n in registry.names("metric")) if getattr(m, rank) is not None]
    return sorted(declared, key=lambda m: (getattr(m, rank), m.name))


def second_views(registry: Registry) -> list[str]:
    """The registered metrics that show leakage beside the leakage metric, by their ``view_rank``."""
    return [m.name for m in ranked_metrics(registry, "view_rank")]


def _worst_image(rows: list[Row], metric) -> WorstImage | None:
    """The single most leaking image of ``rows``: its attack, step, score, target batch and place in the batch
    (None for rows without per-image scores: a label metric, or rows written before they were kept)."""
    best = None
    for r in rows:
        for i, v in enumerate(r.per_image.get(metric.name, [])):
            if v is not None and math.isfinite(v) and (best is None or metric.better(v, best.score)):
                best = WorstImage(r.attack, r.checkpoint, v, r.target, i, r.images[i] if i < len(r.images) else None)
    return best


def _unmeasured_live(utility: list[dict]) -> str:
    """Why a monitored run's setting has no accuracy: no eval_loader, or it is a reference, attacked, not trained."""
    if not utility:
        return "give the monitor an eval_loader of held-out batches"
    return "a reference is attacked, not trained: the monitor measures the accuracy of the model it watches"


def summarise(audit: Audit, rows: list[Row], utility: list[dict], notes: list[str],
              baselines: dict[str, dict[str, float | None]] | None = None, run_info: dict[str, Any] | None = None,
              identifiable: tuple[str, dict[tuple, list | None]] | None = None,
              confirmed: dict[str, dict[str, Any]] | None = None) -> Summary:
    """Per-cell means with bootstrap intervals, the strongest attack and the verdict of each setting, each step's
    verdict calibrated by its model's undefended reference, and identification held to any privacy bound.
    ``confirmed``: each frontier choice's verdict on fresh targets (confirmed.json), which the decision heeds."""
    baselines, run_info = baselines or {}, run_info or {}
    identified_by, identified = identifiable or (None, {})
    guessed = finite(scores.get("pii_recall") for scores in (baselines or {}).values())
    options = {**as_dict(audit.verdict), "unit": example_unit(audit),
               **({"no_utility": _unmeasured_live(utility)} if audit.live else {}),
               **({"pii_guess": max(guessed)} if guessed else {})}
    acc = {u["setting"]: u for u in utility}
    leakage = audit.registry.get("metric", audit.leakage_metric)
    defenses = {s.key: s.build(audit.registry).under(audit.protocol_of(s)) for s in audit.settings}
    fits = federated_fits(audit)
    if fits:  # a federated client's guarantee, composed over the rounds it took part in
        defenses = {key: d.stated_over(fits) for key, d in defenses.items()}
        spent = {key: _spent(d, fits, audit.utility.delta) for key, d in defenses.items()}
        acc = acc | {key: e | {k: v for k, v in acc.get(key, {}).items() if v is not None}
                     for key, e in spent.items() if e}
    profiles = {key: d.privacy_profile() for key, d in defenses.items()}
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        groups[r.cell].append(r)
    cells = [_cell(audit, key, rs, acc, options, notes, leakage, identified.get(key) or (None, None, None), identified_by,
                   profiles.get(key[0])) for key, rs in groups.items()]
    threshold = leak_threshold(baselines, leakage, options["margin"])
    labels_bar = label_threshold(baselines, leakage, options["margin"])
    if labels_bar is not None and audit.threat.known_labels:  # the labels are the threat model's, not the update's
        labels_bar, options["labels_granted"] = None, True
    chance = run_info.get("chance_accuracy")
    needed = min_accuracy(options, chance)
    bars = (leakage, threshold, needed, chance, options, labels_bar)
    untried = run_info.get("untried_attacks", "")
    alone = {s.key: _judged_steps(audit, s, cells, acc, bars) for s in audit.settings}
    verdicts, worst_case = [], []
    for s in audit.settings:
        mine = [c for c in cells if c.setting == s.key and c.mean(leakage.name) is not None]
        if not mine:  # attacked without a finite score, or never attacked (a budget left every attack out): say so
            attacked = any(c.setting == s.key for c in cells)
            worst_case.append(_unjudged(s, audit, acc.get(s.key, {}), leakage.name,
                                        None if attacked else run_info.get("budget") or {}))
            continue
        reference = audit.reference_of(s)
        breaks = lambda label, step: _breaks_at_scale(audit, reference, label, step, cells, acc, bars)  # noqa: E731
        calibration = (untried, unread_kind(audit, s), breaks)
        threats = _by_threat(audit, s, cells, acc, bars, calibration)
        per_step = [dataclasses.replace(v, by_threat=_threats_at(threats, cells, s.key, v.checkpoint))
                    for v in _calibrated(audit, s, alone[s.key], cells, acc, bars, calibration)]
        verdicts.extend(per_step)
        final = overall(per_step)
        assert final is not None, "a setting with a finite score is judged at some step"
        worst_case.append(_worst_case(s, audit, mine, rows, leakage, final, profiles[s.key], acc.get(s.key, {}),
                                      _open_at_some_step(final, per_step), _threats_at(threats, cells, s.key)))
    violations = [f"{c.setting}, {c.attack}, step {c.checkpoint}: {c.bound_violated}"
                  for c in cells if c.bound_violated]
    confidence = options["confidence"]
    assert audit.model.name is not None, "the checks name every model (a factory by its path)"
    return Summary(
        audit=audit.name, leakage_metric=leakage.name, higher_is_more_leakage=leakage.higher_is_better,
        dataset=audit.data.dataset or audit.data.factory, model=audit.model.name, device=audit.device,
        seed=audit.seed, metrics=audit.metrics, checkpoints=audit.checkpoints, verdict_options=audit.verdict,
        leak_threshold=threshold, label_threshold=labels_bar, chance_accuracy=chance, min_accuracy=needed, identifiable_by=identified_by,
        utility={u["setting"]: SettingUtility(
            accuracy=u.get("accuracy"), train_steps=u.get("train_steps"), epsilon=u.get("epsilon"),
            delta=u.get("delta"), model_changes=u.get("model_changes"), checkpoint_accuracy=u.get("checkpoint_accuracy")) for u in utility},
        cells=cells, worst_case=worst_case, verdicts=verdicts, bound_violations=violations,
        naive_vs_adaptive=naive_vs_adaptive(cells, leakage), warnings=notes + _unlearned(audit, acc, needed),
        frontier=[frontier_result(spec, worst_case, acc, leakage, threshold, confidence, confirmed)
                  for spec in audit.frontiers],
        decision=decide(worst_case, acc, needed, confidence, {
            s.key: acc.get(ref.key, {}).get("accuracy") for s in audit.settings
            if (ref := audit.reference_of(s)) is not None and ref is not s},
            audit.utility.max_drop if options.get("min_accuracy") is None else None, confirmed,
            audit.budget_plan))


def federated_fits(audit: Audit) -> int | None:
    """The rounds a federated LeakMonitor's client took part in (its monitor.json's ``fits``), over which each
    per-round guarantee is composed; None for any other audit."""
    fits = (audit.live or {}).get("fits")
    return int(fits) if fits else None


def _spent(defense, rounds: int, delta: float) -> dict[str, float]:
    """Epsilon at ``delta`` that ``defense`` spends over ``rounds`` releases (empty where it states none)."""
    epsilon = defense.privacy_spent(rounds, 1.0, delta)
    return {} if epsilon is None else {"epsilon": epsilon, "delta": delta}


def accuracy_interval(utility: dict, confidence: float) -> list[float] | None:
    """The Wilson interval of a setting's test accuracy over its test split (None where the row does not say
    how many test images it counted)."""
    n, p = utility.get("test_images"), utility.get("accuracy")
    if not n or p is None:
        return None
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    scale = 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / scale, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / scale
    return [max(0.0, centre - half), min(1.0, centre + half)]


def frontier_result(spec: FrontierSpec, worst_case: list[WorstCase], acc: dict, leakage: Metric,
                    threshold: LeakThreshold | None, confidence: float,
                    confirmed: dict[str, dict[str, Any]] | None = None) -> FrontierResult:
    """A frontier search replayed on the summary's verdicts (the run judged each probe the same way): its
    bracket, the protecting setting's accuracy and its margin under the leak threshold, every probe, and the
    protecting setting's verdict on fresh targets where the run confirmed it."""
    by_key = {w.setting: w for w in worst_case}
    found = search(spec, lambda v: getattr(by_key.get(spec.setting(v).key), "verdict", None))
    keys = {v: spec.setting(v).key for v, _ in found.probes}
    top = None if found.protecting is None else by_key.get(keys[found.protecting])
    score = None if top is None else top.mean(leakage.name)
    margin = None if score is None or threshold is None else (
        threshold.value - score if leakage.higher_is_better else score - threshold.value)
    return FrontierResult(
        entry=spec.where, defense=spec.name, knob=spec.knob, protects=spec.protects, range=[spec.low, spec.high],
        tolerance=spec.tolerance, max_probes=spec.probes,
        probes=[FrontierProbe(v, keys[v], verdict, acc.get(keys[v], {}).get("accuracy"))
                for v, verdict in found.probes],
        protecting=found.protecting, protecting_setting=None if top is None else top.setting,
        leaking=found.leaking, leaking_setting=None if found.leaking is None else keys[found.leaking],
        accuracy=None if top is None else top.accuracy,
        accuracy_ci=None if top is None else accuracy_interval(acc.get(top.setting, {}), confidence),
        margin=margin, status=found.status, fresh=None if top is None else (confirmed or {}).get(top.setting))


def decide(worst_case: list[WorstCase], acc: dict, needed: float | None, confidence: float,
           undefended: dict[str, float | None] | None = None, max_drop: float | None = None,
           confirmed: dict[str, dict[str, Any]] | None = None, plan: dict[str, Any] | None = None) -> Decision | None:
    """The setting to ship: the one that protects at the highest accuracy; where none does, which constraint
    binds: privacy (every judged defense leaks; at which level), utility (those that protect are unusable), the
    budget (it cut attacks that a setting's verdict rests on, so a full run could decide otherwise: nothing is
    shipped on a cut run's word), or judgement. ``undefended``: each setting's undefended model's test accuracy, so
    that the decision states what the defense costs against it (``max_drop``: the most a usable setting may
    cost). ``confirmed``: frontier choices' verdicts on fresh targets; a choice that leaks there is not shipped.
    ``plan``: the budget's plan, whose estimate names the budget that settles it."""
    undefended, confirmed = undefended or {}, confirmed or {}

    def cost(w: WorstCase) -> str:
        base = undefended.get(w.setting)
        if base is None or w.accuracy is None:
            return ""
        allowed = "" if max_drop is None else f" (utility.max_drop allows {max_drop:.3g})"
        return (f"; it costs {base - w.accuracy:.3f} in test accuracy against the undefended model's {base:.3f}"
                f"{allowed}")

    defended = [w for w in worst_case if not w.baseline]
    if not defended:
        return None
    def most_accurate(settings: list[WorstCase]) -> tuple[WorstCase, list[float] | None]:
        best = max(settings, key=lambda w: -1.0 if w.accuracy is None else w.accuracy)
        return best, accuracy_interval(acc.get(best.setting, {}), confidence)

    protecting = [w for w in defended if w.verdict == PROTECTS]
    refuted = [w for w in protecting if confirmed.get(w.setting, {}).get("verdict") == LEAKS]
    protecting = [w for w in protecting if w not in refuted]
    opened = [w for w in defended if w.budget and w.verdict != LEAKS]
    if opened:
        return _budget_binds(opened, protecting, plan, most_accurate)
    if protecting:
        best, interval = most_accurate(protecting)
        fresh = _fresh_words(confirmed.get(best.setting)) if best.setting in confirmed else (
            ". It was not attacked on fresh targets" if refuted else "")
        return Decision(best.setting, best.verdict, best.accuracy, interval, None, f"of the {len(protecting)} "
                        f"protecting, it keeps the highest test accuracy ({_acc(best.accuracy)}){cost(best)}; "
                        f"{best.reason}{fresh}{_refuted_words(refuted)}")
    unusable = [w for w in defended if w.verdict == UNUSABLE]
    if unusable:
        best, interval = most_accurate(unusable)
        return Decision(None, None, best.accuracy, interval, "utility",
                        f"no setting protects while usable: {_protecting(len(unusable))} stays under the "
                        f"accuracy a usable model needs ({_acc(_needed_by(best, needed, undefended, max_drop))}); "
                        f"the most accurate of them, {best.setting}, "
                        f"reaches {_acc(best.accuracy)}{cost(best)}. Search between it and the strongest setting that leaks "
                        f"(frontier:), or try a defense that costs less accuracy{_refuted_words(refuted)}")
    leaking = [w for w in defended if w.verdict == LEAKS] + refuted
    if leaking:
        level = _least_level(leaking)
        least = "" if level in GATE_LEVELS[INDIVIDUALS] else f", each at least its {level}" + (
            "; none need leak individuals, so the gate at its default level (--fail-on-leak individuals) passes "
            "them, and --fail-on-leak labels fails them" if all(gate_reading(w) is None for w in leaking) else
            "; whether they leak individuals is open, so the gate at its default level reads them inconclusive")
        return Decision(None, None, None, None, "privacy",
                        f"no setting protects: all {len(leaking)} judged defended settings leak"
                        f"{'' if len(leaking) == len(defended) else ' (the rest could not be judged)'}{least}; "
                        "try stronger settings", level=level)
    return Decision(None, None, None, None, "judgement", "no defended setting could be judged (inconclusive or "
                    "not judged: see each setting's reason); the audit cannot say which setting to ship")


def _budget_binds(opened: list[WorstCase], protecting: list[WorstCase], plan: dict[str, Any] | None,
                  most_accurate) -> Decision:
    """The decision of a run whose budget cut attacks that the verdicts of ``opened`` rest on: nothing shipped, the
    setting that protects as the budget ran (if any) named, and the budget that runs the audit in full."""
    assert plan is not None, "only a budget's plan leaves a verdict open"
    full = f"about {duration_text(plan['estimate'])} (budget: {full_budget(plan)}, or none)"
    names = ", ".join(w.setting for w in opened) + f" rest on ({'; '.join(plan['cut'])})"
    if protecting:
        best, interval = most_accurate(protecting)
        head = (f"{best.setting} protects at test accuracy {_acc(best.accuracy)} against the attacks as the budget ran "
                f"them, but the budget of {duration_text(plan['seconds'])} cut attacks that the verdicts of {names}")
        return Decision(None, None, best.accuracy, interval, "budget",
                        f"{head}, so a full run could ship another setting or none; run the audit in full, {full}, "
                        "to settle it")
    return Decision(None, None, None, None, "budget",
                    f"the budget of {duration_text(plan['seconds'])} cut attacks that the verdicts of {names}, "
                    f"so a full run could find one that protects, or none; run the audit in full, {full}, to settle it")


def _least_level(leaking: list[WorstCase]) -> str:
    """The least that every one of ``leaking`` leaks (a leak of an older summary, which names no level, counts as
    one of individuals)."""
    return max((w.level or INDIVIDUALS for w in leaking), key=LEVELS.index)


def budget_open(audit: Audit, setting, verdict: StepVerdict, breaks_at_scale) -> StepVerdict:
    """``verdict`` held against the audit's budget: where the plan left out an attack that runs on ``setting`` at
    the verdict's step, or scaled one down that (``breaks_at_scale(label, step)``) did not still break the undefended
    reference there at the level of individuals, a "protects" (or "protects but unusable") is inconclusive (budget),
    and a leak of a lesser level than individuals may be one of individuals in full: both say so (``budget``). A
    leak of individuals, which no further attack can make kinder, is left as it is."""
    plan = audit.budget_plan
    if not cuts_anything(plan) or verdict.verdict is None or (
            verdict.verdict == LEAKS and (verdict.level or INDIVIDUALS) in GATE_LEVELS[INDIVIDUALS]):
        return verdict
    assert plan is not None, "cuts_anything holds a plan"
    step = verdict.checkpoint
    left_out = [a.label for a in audit.budget_left_out if a.applies_to(setting) and a.runs_at(step)]
    scaled = [a.label for a in audit.attacks if a.label in plan["params"] and a.applies_to(setting) and a.runs_at(step)]
    if verdict.verdict in (PROTECTS, UNUSABLE):
        scaled = [label for label in scaled if not breaks_at_scale(label, step)]
    if not left_out and not scaled:
        return verdict
    done = " and ".join(part for part in (
        f"left out {', '.join(left_out)}" if left_out else "",
        f"scaled down {', '.join(scaled)}" + (" (which at that scale did not break the undefended update at the level "
                                              "of individuals)" if verdict.verdict != LEAKS else "") if scaled else "")
        if part)
    words = (f"the budget of {duration_text(plan['seconds'])} {done}; a full run attacks this setting at step {step} "
             f"with them, and takes about {duration_text(plan['estimate'])} (budget: {full_budget(plan)}, or none)")
    if verdict.verdict in (PROTECTS, UNUSABLE):
        return dataclasses.replace(verdict, verdict=INCONCLUSIVE, alone=verdict.verdict, level=None, budget=words,
                                   reason=f"inconclusive (budget): {words}. Judged with the attacks as the budget ran "
                                          f"them: {verdict.verdict}: {verdict.reason}")
    return dataclasses.replace(verdict, budget=words, reason=f"{verdict.reason}; {words}")


def _breaks_at_scale(audit: Audit, reference, label: str, step: int, cells: list[CellResult], acc: dict,
                     bars: tuple) -> bool:
    """Whether attack ``label``, at the scale the budget ran it, broke the undefended ``reference`` at ``step`` at
    the level of individuals (strongly: a weak break vouches for no "protects" of individuals)."""
    if reference is None:
        return False
    judged = [v for v in _judged_steps(audit, reference, cells, acc, bars, {label}) if v.checkpoint == step]
    return bool(judged) and vouched_level(judged[0]) in GATE_LEVELS[INDIVIDUALS]


def _needed_by(w: WorstCase, needed: float | None, undefended: dict[str, float | None], max_drop: float | None):
    """The accuracy setting ``w`` needs to be usable: ``needed``, raised to its undefended model's less
    ``max_drop`` where both are known."""
    base = undefended.get(w.setting)
    if base is None or max_drop is None:
        return needed
    return max(base - max_drop, needed if needed is not None else 0.0)


def _fresh_words(fresh: dict[str, Any] | None) -> str:
    """What the decision says of a frontier choice's verdict on fresh targets ("" where none was sought)."""
    if fresh is None:
        return ""
    if fresh.get("verdict") is None:
        return f". On fresh targets: {fresh['reason']}"
    if fresh["verdict"] not in PROTECTING:
        return (f". Not confirmed on {fresh['targets']} fresh targets that took no part in the search: "
                f"{fresh['verdict']} there ({fresh['reason']})")
    return (f". Confirmed on {fresh['targets']} fresh targets that took no part in the search: {fresh['verdict']} "
            f"({fresh['reason']})")


def _refuted_words(refuted: list[WorstCase]) -> str:
    """The frontier choices not shipped because they leak on fresh targets ("" where none)."""
    if not refuted:
        return ""
    return (f"; not shipped: {', '.join(w.setting for w in refuted)}, which protected on the searched targets but "
            "leaks on fresh ones")


def _protecting(n: int) -> str:
    return "the one setting that protects" if n == 1 else f"each of the {n} settings that protect"


def _acc(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.3f}"


def calibrates(audit: Audit, attack, setting) -> bool:
    """Whether ``attack``'s run on the undefended reference vouches for ``setting``'s "protects": it runs on the
    setting, and reads its updates (an attack of noise-free updates only says nothing of a defense that adds
    noise; one that does not read the kind of update the defense shares, LoRA's adapters say, nothing of it)."""
    if not attack.applies_to(setting):
        return False
    cls = audit.registry.get("attack", attack.name)
    noisy = any(not audit.registry.get("defense", name).deterministic for name, _ in setting.members)
    return not (noisy and cls.noise_free_only) and reads_all(cls, shared_kinds(audit, setting))


def reads_all(attack_class, kinds: set[str]) -> bool:
    """Whether an attack (its class) reads every kind of update in ``kinds`` (``Attack.reads``)."""
    return kinds <= set(attack_class.reads)


def shared_kinds(audit: Audit, setting) -> set[str]:
    """The kinds of update ``setting``'s defenses leave shared where they change it (``Defense.shares``; the full
    update left out)."""
    return {audit.registry.get("defense", name).shares for name, _ in setting.members} - {FULL}


def unread_kind(audit: Audit, setting) -> str:
    """Why no attack run on ``setting`` can calibrate its "protects": its defenses share a kind of update that
    none of them reads, with the registered attacks that do; "" where one does (or the update is the full one)."""
    kinds = shared_kinds(audit, setting)
    if not kinds or any(a.applies_to(setting) and reads_all(audit.registry.get("attack", a.name), kinds)
                        for a in audit.attacks):
        return ""
    readers = sorted(n for n, e in audit.registry.entries["attack"].items() if reads_all(e.obj, kinds))
    what = "; ".join(f"{k}: {UPDATE_KINDS.get(k, k)}" for k in sorted(kinds))
    return (f"{setting.key} shares only {what}, and no attack run on it reads that kind of update, so none could "
            f"have broken it; registered attacks that read it: {', '.join(readers) or 'none'} (one that refuses "
            "this setting, where a span's rank cannot hold the batch, says why in leakaudit validate)")


def scored_batch(audit: Audit, setting, cells: list[CellResult]) -> int:
    """The images scored per update of ``setting`` in ``cells``: each client's share where every update was read as
    the first client's own coordinates (per-element secure aggregation), else the whole update's."""
    own = [c.own_coordinates for c in cells]
    if own and all(counts and all(counts) for counts in own):
        return audit.images_per_client
    return audit.batch_size_of(setting)


def _batch_options(options: dict, batch: int) -> dict:
    """The verdict options for updates of ``batch`` images (a batch is identified among decoys, not 1 in N)."""
    return {**options, "batch_size": batch}


def _judged_steps(audit: Audit, setting, cells: list[CellResult], acc: dict, bars: tuple,
                  attacks: set[str] | None = None) -> list[StepVerdict]:
    """A setting's verdict, judged alone, at each step it has a finite score, from its cells (those of
    ``attacks`` only, where given); ``bars``: the leakage metric, leak threshold, usable accuracy, chance, the
    verdict options and the bar of a leak of labels."""
    leakage, threshold, needed, chance, options, labels_bar = bars
    mine = [c for c in cells if c.setting == setting.key and (attacks is None or c.attack in attacks)
            and c.mean(leakage.name) is not None]
    options = _batch_options(options, scored_batch(audit, setting, mine))
    reference = audit.reference_of(setting)
    undefended = None if reference is None else acc.get(reference.key, {}).get("accuracy")
    options = {**options, "undefended": undefended, "max_drop": audit.utility.max_drop}
    needed = min_accuracy(options, chance, undefended, audit.utility.max_drop)
    accuracy = acc.get(setting.key, {}).get("accuracy")
    return [_held_against(audit, judge([c for c in mine if c.checkpoint == ckpt], leakage, threshold, accuracy, needed,
                                       chance, options, labels_bar), [c for c in mine if c.checkpoint == ckpt])
            for ckpt in audit.checkpoints if any(c.checkpoint == ckpt for c in mine)]


def _by_threat(audit: Audit, setting, cells: list[CellResult], acc: dict, bars: tuple,
               calibration: tuple) -> dict[str, tuple[set[str], list[StepVerdict]]]:
    """Each threat model's attacks and verdicts of ``setting`` per step, weakest attacker first, where the attacks
    run on it span more than one (``Attack.attacker``, Carletti et al. 2025): judged on the attacks that attacker
    can run, each calibrated by the reference judged on the same, so that a "protects" that only a malicious
    server's attack vouches for is never said of a passive one. Empty where they span one."""
    order = list(ATTACKERS)
    needs = {a.key: _attacker_of(audit, a.key) for a in audit.attacks}
    ran = {c.attack for c in cells if c.setting == setting.key}
    levels = [t for t in order if any(needs.get(a) == t for a in ran)]
    if len(levels) < 2:
        return {}
    out = {}
    for threat in levels:
        allowed = {a for a, t in needs.items() if t in order and order.index(t) <= order.index(threat)}
        alone = _judged_steps(audit, setting, cells, acc, bars, allowed)
        out[threat] = allowed, _calibrated(audit, setting, alone, cells, acc, bars, calibration, allowed)
    return out


def _calibrated(audit: Audit, setting, alone: list[StepVerdict], cells: list[CellResult], acc: dict, bars: tuple,
                calibration: tuple, allowed: set[str] | None = None) -> list[StepVerdict]:
    """``setting``'s verdicts judged ``alone``, each step calibrated by its reference judged on the attacks that ran
    on this setting (of those ``allowed``, where given: a weak attack's "protects" is not vouched for by a stronger
    attack that ran elsewhere), and left open where the budget cut what it rests on (``budget_open``)."""
    untried, unread, breaks = calibration
    reference = audit.reference_of(setting)
    steps = [] if reference is None else alone if reference is setting else _judged_steps(
        audit, reference, cells, acc, bars, {a.key for a in audit.attacks if calibrates(audit, a, setting)
                                             and (allowed is None or a.key in allowed)})
    by_step = {v.checkpoint: v for v in steps}
    return [budget_open(audit, setting, calibrate(v, by_step.get(v.checkpoint), untried, unread), breaks)
            for v in alone]


def _threats_at(threats: dict[str, tuple[set[str], list[StepVerdict]]], cells: list[CellResult], setting: str,
                step: int | None = None) -> list[ThreatVerdict] | None:
    """The threat models' verdicts at ``step`` (None: each one's worst step), with the attacks each judged there."""
    if not threats:
        return None
    out = []
    for threat, (allowed, verdicts) in threats.items():
        v = overall([v for v in verdicts if step is None or v.checkpoint == step])
        if v is None:
            continue
        named = sorted({c.attack for c in cells if c.setting == setting and c.attack in allowed
                        and c.checkpoint == v.checkpoint})
        out.append(ThreatVerdict(threat=threat, verdict=v.verdict, level=v.level, attack=v.attack,
                                 checkpoint=v.checkpoint, attacks=named))
    return out


def _attacker_of(audit: Audit, attack: str) -> str:
    """The attacker an audit's attack (by key) declares it needs ("" where none or unknown)."""
    spec = next((a for a in audit.attacks if a.key == attack), None)
    return "" if spec is None else audit.registry.get("attack", spec.name).attacker


def _held_against(audit: Audit, verdict: StepVerdict, cells: list[CellResult]) -> StepVerdict:
    """The verdict with the attacker it holds against (each attack's declared ``attacker``, Carletti et al. 2025):
    a leak, the one its strongest attack needs; anything else, the strongest that the attacks run there need."""
    if verdict.verdict == LEAKS:
        return dataclasses.replace(verdict, threat=_attacker_of(audit, verdict.attack))
    declared = [_attacker_of(audit, c.attack) for c in cells]
    known = [a for a in declared if a in ATTACKERS]
    strongest = max(known, key=list(ATTACKERS).index) if known else ""
    return dataclasses.replace(verdict, threat=strongest)


def _cell(audit: Audit, key: tuple, rs: list[Row], acc: dict, options: dict, notes: list[str], leakage,
          identified: Sequence[Any], identified_by: str | None, profile) -> CellResult:
    """One (setting, attack, checkpoint)'s statistics over its rows: per metric mean, std, interval and count;
    its most leaking image; its identifiable share and the bound a privacy guarantee sets on it; convergence."""
    setting, attack, ckpt = key
    roles = {a.key: a.role for a in audit.attacks}
    scores = {}
    for m in audit.metrics:
        values = [v for r in rs for v in r.per_image_of(m)]
        scores[m] = cell_statistics(values, m, key, audit.seed, options["confidence"], options["bootstrap"])
        bad = sum(1 for v in values if v is not None and not math.isfinite(v))
        if bad:
            notes.append(f"{setting}, {attack}, step {ckpt}: {bad} of {len(values)} images have a non-finite {m} "
                         "(the model or the reconstruction diverged); the cell leaves them out")
    own = next((s for s in audit.settings if s.key == setting), None)
    batch = audit.data.batch_size if own is None else audit.batch_size_of(own)
    n = sum(len(r.images) or batch for r in rs)  # the first client's images alone where its coordinates were read
    counts = [r.own_coordinates for r in sorted(rs, key=lambda r: r.target)]
    share, named, decoys = identified
    bound = identification_bound(profile, batch, n)
    gains = finite(r.late_gain for r in rs)
    gain = float(np.mean(gains)) if gains else None
    return CellResult(
        defense=rs[0].defense, setting=setting, params=rs[0].params, attack=attack,
        role=roles.get(attack, "naive"), checkpoint=ckpt, targets=len(rs), accuracy=acc.get(setting, {}).get("accuracy"),
        epsilon=acc.get(setting, {}).get("epsilon"), scores=scores, worst_image=_worst_image(rs, leakage),
        identifiable=share, named=named, identifiable_by=identified_by, identifiable_n=n, rero_bound=bound,
        decoy_hits=None if decoys is None else decoys[0], decoy_p=None if decoys is None else decoys[2],
        bound_violated=beats_bound(named, n, bound, options["confidence"], options.get("unit", "image")), late_gain=gain,
        still_improving=None if gain is None else gain > STILL_IMPROVING, iterations=_iterations(audit, attack, rs),
        seconds_mean=float(np.mean([r.seconds for r in rs])),
        pii_recall=float(np.mean(recalls)) if (recalls := finite(r.pii_recall for r in rs)) else None,
        own_coordinates=None if all(c is None for c in counts) else [c or 0 for c in counts])


def _iterations(audit: Audit, attack: str, rows: list[Row]) -> int | None:
    """The iterations an attack ran with in these rows (its tuned, else configured, else default), if it has any."""
    spec = next((a for a in audit.attacks if a.key == attack), None)
    params = rows[0].attack_params or (spec.params if spec is not None else {})
    if "iterations" in params:
        return params["iterations"]
    declared = audit.registry.get("attack", spec.name).params.get("iterations") if spec is not None else None
    return None if declared is None else declared.default


def _open_at_some_step(final: StepVerdict, per_step: list[StepVerdict]) -> str | None:
    """How the budget leaves a setting's verdict over the steps open: its worst step's words, or where that step is
    a leak of less than individuals, those of any step the budget left open (a full run may leak more there)."""
    if final.budget or final.verdict != LEAKS or (final.level or INDIVIDUALS) in GATE_LEVELS[INDIVIDUALS]:
        return final.budget
    return next((v.budget for v in per_step if v.budget), None)


def _worst_case(s, audit: Audit, mine: list[CellResult], rows: list[Row], leakage, final: StepVerdict, profile,
                utility: dict, budget: str | None, by_threat: list[ThreatVerdict] | None) -> WorstCase:
    """A setting's entry in the summary's worst case: its verdict over the steps (``budget``: how the budget leaves
    it open; ``by_threat``: under each threat model, whose words join the reason where only a malicious server
    reaches individuals), the strongest attack at that verdict's step, and where it has a privacy guarantee the
    bound beside the measured identification."""
    passive = passive_words(by_threat)
    top, _ = strongest([c for c in mine if c.checkpoint == final.checkpoint] or mine, leakage)  # the why-line's step
    views = second_views(audit.registry)
    own_rows = [r for r in rows if r.setting == s.key]
    return WorstCase(
        **_setting_fields(s, audit), accuracy=top.accuracy, epsilon=top.epsilon, identifiable=top.identifiable,
        attack=top.attack, checkpoint=top.checkpoint,
        scores={m: top.scores[m] for m in (leakage.name, *views) if m in top.scores},
        n=top.scores[leakage.name].n, verdict=final.verdict, reason=final.reason + (f"; {passive}" if passive else ""),
        verdict_checkpoint=final.checkpoint, still_improving=final.still_improving, level=final.level,
        threat=final.threat, weak=final.weak, borderline=final.borderline, budget=budget, by_threat=by_threat,
        settling_iterations=final.settling_iterations,
        privacy=_privacy(profile, mine, scored_batch(audit, s, mine), utility, own_rows,
                         (audit.live or {}).get("claimed")),
        worst_image=_worst_image(own_rows, leakage))


def _setting_fields(setting, audit: Audit) -> dict[str, Any]:
    """What a worst case says of its setting: name, key, parameters and its place in the audit."""
    return dict(defense=setting.name, setting=setting.key, params=setting.params,
                baseline=setting.is_baseline(audit.registry), reference=setting.calibrates is not None,
                added=setting.added, must_protect=setting.must_protect, clients=setting.clients)


def _privacy(profile, mine: list[CellResult], batch: int, utility: dict, rows: list[Row],
             claimed: list[str] | None = None) -> Privacy | None:
    """A guaranteed setting's privacy beside its attacks: mu, the bound on naming targets, the most any of its
    attacks named (and whether some cell beat the bound), what the training's epsilon bounds, the prior-free
    PSNR and MSE bounds (the rows' ``prior_free``) with any attack whose mean PSNR got past them, and what the
    framework's own accountant ``claimed``."""
    if profile is None:
        return None
    top = max(mine, key=lambda c: -1 if c.named is None else c.named)
    chance = batch / top.identifiable_n
    first = next((r for r in rows if r.prior_free), None)
    corridor = [r.prior_free for r in rows if r.prior_free and (r.attack, r.checkpoint) == (
        first.attack, first.checkpoint)] if first else []  # one cell's rows: each target once
    psnr = float(np.mean([c["psnr"] for c in corridor])) if corridor else None
    past = [(m - psnr, c) for c in mine if psnr is not None and (m := c.mean("psnr") or -math.inf) > psnr]
    gap, over = max(past, key=lambda p: p[0]) if past else (None, None)
    return Privacy(mu=profile.mu, mechanism=profile.mechanism, bound=top.rero_bound, identified=top.named,
                   identified_by=top.attack, identified_n=top.identifiable_n, chance=chance,
                   violated=any(bool(c.bound_violated) for c in mine),
                   training_bound=training_bound(utility.get("epsilon"), utility.get("delta"), chance),
                   prior_free_psnr=psnr, prior_free_mse=float(np.mean([c["mse"] for c in corridor])) if corridor else None,
                   claimed=tuple(claimed or ()), past_prior_free="" if over is None else (
                       f"{over.attack} reaches psnr {over.mean('psnr'):.3g} at step {over.checkpoint}, {gap:.2g} dB past "
                       "the prior-free bound: its data prior (or image priors) can do that"))


def _unlearned(audit: Audit, utility: dict[str, dict], needed: float | None) -> list[str]:
    """A warning where the file's undefended model itself ends its training unusable: its training does not learn,
    so every defense's utility reads unusable for a reason that is not the defense's."""
    if needed is None or not audit.utility.train_steps:
        return []
    delta = (" (where the update is a model change rather than one gradient, utility.lr is the server's step on "
             "the client's theta_before - theta_after: FedAvg adds it as it is, lr 1.0)"
             if not audit.protocol.sends_gradient else "")
    out = []
    for s in audit.settings:
        accuracy = utility.get(s.key, {}).get("accuracy")
        if s.calibrates is not None and s.model is None and accuracy is not None and accuracy < needed:
            out.append(f"{s.key}: the undefended model's test accuracy after utility.train_steps "
                       f"{audit.utility.train_steps} is {accuracy:.2f}, under the {needed:.2f} a usable model needs: "
                       f"its training does not learn, so every setting reads unusable; raise utility.lr or "
                       f"train_steps{delta}")
    return out


def _unjudged(setting, audit: Audit, utility: dict, metric: str, unattacked: dict | None = None) -> WorstCase:
    """The worst-case entry of a setting whose every reconstruction scored no finite ``metric``, or, where
    ``unattacked`` holds the run's budget plan (or ``{}``), that no attack ran on."""
    if unattacked is None:
        reason = (f"not judged: no attack scored a finite {metric} (every reconstruction diverged, or the metric "
                  "could not be computed; see the warnings)")
    else:
        dropped = ", ".join(unattacked.get("dropped") or {})
        reason = "not judged: no attack ran on it" + (f"; the budget left out {dropped} (see the run's budget)"
                                                      if dropped else "")
    return WorstCase(
        **_setting_fields(setting, audit), accuracy=utility.get("accuracy"), epsilon=utility.get("epsilon"),
        identifiable=None, attack=None, checkpoint=None, scores={metric: Scores()}, n=0, verdict=None,
        reason=reason, verdict_checkpoint=None)


def naive_vs_adaptive(cells: list[CellResult], metric) -> list[NaiveVsAdaptive]:
    """Per setting and step: the strongest naive and the strongest adaptive attack's mean leakage score, and the gap.

    Only where both kinds ran. ``gap`` is in the metric's units, positive when the adaptive attack leaks
    more: how much safer the defense looks than it is; negative when the adaptive attack did worse.
    """
    best: dict[tuple, dict[str, CellResult]] = defaultdict(dict)
    for c in cells:
        if c.mean(metric.name) is None:
            continue
        slot = best[(c.setting, c.checkpoint)]
        if c.role not in slot or metric.better(judged_mean(c, metric.name), judged_mean(slot[c.role], metric.name)):
            slot[c.role] = c
    out = []
    for (setting, ckpt), slot in best.items():
        if len(slot) == 2:
            naive, adaptive = slot["naive"], slot["adaptive"]
            n, a = judged_mean(naive, metric.name), judged_mean(adaptive, metric.name)
            out.append(NaiveVsAdaptive(
                defense=naive.defense, setting=setting, checkpoint=ckpt, metric=metric.name, accuracy=naive.accuracy,
                naive_attack=naive.attack, naive_score=n, adaptive_attack=adaptive.attack, adaptive_score=a,
                gap=(a - n) if metric.higher_is_better else (n - a)))
    return out


def summarise_tuning(audit: Audit, trials: list[dict], notes: list[str]) -> list[TuningResult]:
    """Per (setting, attack, checkpoint): the search's budget, the untuned and the winning score and setting,
    and where the winner sits on each grid (a scan's best on the scan's own range); a winner on a grid's edge
    adds a warning to ``notes``."""
    best = winners(trials, audit.registry)
    out = []
    for key, win in best.items():
        mine = [t for t in trials if (t["setting"], t["attack"], t["checkpoint"]) == key]
        untuned = next(t for t in mine if t["trial"] == 0)
        spec = next(a.tune for a in audit.attacks if a.key == key[1])
        assert spec is not None, "trials are of tuned attacks"
        changed = {k: v for k, v in win["params"].items() if untuned["params"].get(k) != v}
        where = f"{key[0]}, {key[1]}, step {key[2]}"
        scanned = scan_best(spec, mine, sum(t.get("stage") == "scan" for t in mine), audit.registry) \
            if spec.scan else None
        space = spec.space_after(scanned)
        positions = grid_positions(space, win["params"]) if win["trial"] != 0 else {}
        for name, place in positions.items():
            if place in ("lowest", "highest"):
                notes.append(f"{where}: the tuned {name}={value_at(win['params'], name)} is the {place} value "
                             f"of its grid {space[name]}; the best may lie beyond it: widen the grid")
        if spec.scan:
            name, place = spec.scan.param, position(spec.scan.values(), scanned)
            if place in ("lowest", "highest"):
                notes.append(f"{where}: the scan's best {name}={scanned} is the {place} value of its scan "
                             f"{spec.scan.low:g}..{spec.scan.high:g}; the best may lie beyond it: widen the scan")
            positions = {f"scan {name}": f"{scanned:g} ({'untuned' if place == 'off the grid' else place})",
                         **positions}
        out.append(TuningResult(
            setting=key[0], attack=key[1], checkpoint=key[2], metric=win["metric"], budget=spec.budget,
            trials=len(mine), tuning_batches=spec.targets, untuned=untuned["score"], tuned=win["score"],
            winner=changed or "untuned", on_grid="; ".join(f"{k}: {v}" for k, v in positions.items()) or "untuned won",
            search_seconds=round(sum(t["seconds"] for t in mine), 1)))
    return out
