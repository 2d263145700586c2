"""Time before work: an audit's wall time on this machine, from costs measured on its own cells (the cost of one
training step under each setting, of each attack's fixed part and of one unit of its ``budget`` parameter), cached
per machine, torch and device as the architecture analysis is; and the plan that fits an audit into ``budget:``.

A cell's time is ``fixed + sum of per_unit[p] * units[p]`` over the attack's budget parameters (``Param.budget``:
its iterations, Learning to Invert's simulated updates too), each measured by running the cell (every target batch
of one setting, at step 0) at a few of its units; an attack without one is run once in full.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.audit.budget import apply_plan, duration_text, settles_early
from leakaudit.evaluator.audit.jobs import cells_of, jobs_of, tune_jobs_of
from leakaudit.evaluator.audit.types import AttackSpec, Audit, ConfigError, DefenseSetting
from leakaudit.evaluator.results.rundir import RunFolder
from leakaudit.evaluator.run.executors import auto_workers
from leakaudit.evaluator.run.scenario import Scenario, cache_root, write_cached
from leakaudit.evaluator.run.utility import accuracy, training_run
from leakaudit.evaluator.run.worker import AuditWorker
from leakaudit.evaluator.zoo.metrics import score
from leakaudit.plugins.attack import solve

ESTIMATE_VERSION = 2  # bump when what a probe measures changes
#: A probe adds units until its measured part takes this long (seconds): long enough to time, short enough to wait.
PROBE_SECONDS = 0.3
#: Past one raise of its units, a probe stops raising them once a cell takes this long (seconds): a heavy cell's
#: noise can hide a cheap unit's cost (learning_to_invert's iterations beside its 64-image FedAvg updates), and
#: fourfold cells after it would take hours; the unit's cost is then read from the raises measured.
PROBE_CAP_SECONDS = 60.0
#: A fresh process's start before its first job: Python, torch and leakaudit imported, the registry loaded.
START_CODE = ("import leakaudit.evaluator.run.runner; from leakaudit.plugins.manager import load_registry; "
              "load_registry([])")
#: Writing the report: the guesses' scores, identification, figures and the page (seconds).
REPORT_SECONDS = 6.0
#: The smallest share of an attack's budget parameter a ``budget:`` scales it to; below it the attack is left out.
MIN_SHARE = 1 / 8


@dataclass(frozen=True)
class Cost:
    """A measured cost: ``fixed + sum of per_unit[p] * units[p]`` seconds for ``problems`` target batches (a
    training's: ``per_unit["steps"]``)."""

    fixed: float
    per_unit: dict[str, float]
    problems: int = 1

    def seconds(self, units: Mapping[str, float], problems: float | None = None) -> float:
        share = 1.0 if problems is None else problems / self.problems
        return (self.fixed + sum(c * units[p] for p, c in self.per_unit.items())) * share


@dataclass
class Estimate:
    """An audit's predicted wall time on this machine, by phase, with the work it counts."""

    workers: int
    training: dict[str, float]  # setting key -> seconds
    tuning: dict[tuple, float]  # (setting, attack, step) -> seconds
    cells: dict[tuple, float]  # (setting, attack, step) -> seconds of all its target batches
    wall: dict[str, float] = field(default_factory=dict)  # phase -> seconds, as the workers share it
    frontier_probe: float = 0.0  # one more probe of a frontier search (training and attacks of one setting)
    settles: bool = False  # a step's attacks stop once its verdict is settled: the whole is an upper bound

    @property
    def total(self) -> float:
        return sum(self.wall.values())

    def attack_seconds(self, label: str) -> float:
        """What one attack's cells take, summed over settings and steps (one worker's time)."""
        return sum(s for (_, a, _), s in self.cells.items() if a == label)

    def lines(self) -> list[str]:
        """The estimate as the terminal shows it: the total, then each phase and each attack."""
        parts = [f"{phase} {duration_text(s)}" for phase, s in self.wall.items() if s >= 0.5]
        where = f"{self.workers} worker process{'es' if self.workers > 1 else ''}"
        about = "at most about" if self.settles else "about"
        out = [f"estimated time on this machine: {about} {duration_text(self.total)} ({', '.join(parts)}; {where})"]
        labels = dict.fromkeys(a for _, a, _ in self.cells)
        if labels:
            out.append("  attacks, one worker's time each: " + "; ".join(
                f"{a} {duration_text(self.attack_seconds(a))}" for a in labels))
        if self.frontier_probe:
            out.append(f"  each further frontier probe: about {duration_text(self.frontier_probe)}")
        return out


def budget_params(registry, name: str) -> dict[str, int]:
    """The attack's parameters its work grows with (``Param.budget``), each with the least value it takes."""
    return {k: max(1, int(p.min or 1)) for k, p in registry.get("attack", name).params.items() if p.budget}


def units_of(audit: Audit, spec: AttackSpec, params: dict | None = None) -> dict[str, float]:
    """The values of ``spec``'s budget parameters it runs with."""
    given = spec.params if params is None else params
    declared = audit.registry.get("attack", spec.name).params
    return {p: float(given.get(p, declared[p].default)) for p in budget_params(audit.registry, spec.name)}


class Calibration:
    """The measured costs of one audit's cells and trainings on this machine, read from and added to the cache."""

    def __init__(self, scenario: Scenario, threads: int):
        self.scenario, self.threads = scenario, threads
        self.path = cache_dir() / f"{_machine_key(scenario, threads)}.json"
        self.saved: dict[str, list[Any]] = _read(self.path)  # each cost as [fixed, per_unit]
        self.worker = AuditWorker(scenario, RunFolder(cache_dir() / "probe", scenario.audit))  # never written

    def attack(self, setting: DefenseSetting, spec: AttackSpec) -> Cost:
        """The cost of ``spec`` on every target batch of ``setting`` at one step."""
        audit = self.scenario.audit
        n = audit.num_batches_of(setting)
        fixed = {k: v for k, v in spec.params.items() if k not in budget_params(audit.registry, spec.name)}
        key = repr(("attack", spec.name, code_of(audit.registry.get("attack", spec.name)), sorted(fixed.items()),
                    self._world(setting), n))
        if key not in self.saved:
            self.saved[key] = list(self._probe_attack(setting, spec))
        return _cost(self.saved[key], n)

    def training(self, setting: DefenseSetting) -> Cost:
        """The cost of the utility training under ``setting``: set-up and accuracy checks, and one step."""
        key = repr(("train", self._world(setting), sorted(dataclasses.asdict(self.scenario.audit.utility).items()),
                    self.scenario.audit.checkpoints))
        if key not in self.saved:
            self.saved[key] = list(self._probe_training(setting))
        return _cost(self.saved[key])

    def start(self) -> float:
        """Seconds a fresh process takes to import the engine and load the registry: the command's own start, and
        each worker process's (spawned together)."""
        if "start" not in self.saved:
            self.saved["start"] = [_time_start(), {}]
        return float(self.saved["start"][0])

    def save(self) -> None:
        write_cached(self.path, self.saved)

    def _world(self, setting: DefenseSetting) -> str:
        """What a cost depends on besides the attack: the setting, its model, data shape, protocol and options."""
        audit = self.scenario.audit
        return repr((setting.identity, dataclasses.asdict(self.scenario.model_section(setting)),
                     audit.data.dataset, audit.data.factory, audit.data.image_size, audit.batch_size_of(setting),
                     repr(audit.protocol_of(setting)), audit.max_problems, audit.precision, audit.compile,
                     audit.metrics, audit.threat.known_labels))

    def _probe_attack(self, setting: DefenseSetting, spec: AttackSpec) -> tuple[float, dict[str, float]]:
        """Run the cell with every budget parameter at its least value, then raise one parameter at a time to 4,
        16, ... times that until the added units take ``PROBE_SECONDS`` (or its full value is reached), the next
        one probed from there (a unit of one can cost more with more of another: Learning to Invert's training
        steps read minibatches of its simulated updates), raised no further once a cell takes
        ``PROBE_CAP_SECONDS``: the fixed part and the cost of a unit of each."""
        audit = self.scenario.audit
        held = budget_params(audit.registry, spec.name)
        full = units_of(audit, spec)
        first = self._time_cell(setting, spec, held)
        base = min(first, self._time_cell(setting, spec, held)) if held and first < 5.0 else first  # warmed up
        per_unit = {}
        for name, low in list(held.items()):
            units, seconds = low, base
            while units < full[name] and (units == low or (seconds - base < PROBE_SECONDS
                                                            and seconds < PROBE_CAP_SECONDS)):
                units = int(min(4 * units, full[name]))
                seconds = self._time_cell(setting, spec, {**held, name: units})
            per_unit[name] = max(0.0, (seconds - base) / (units - low)) if units > low else 0.0
            held[name], base = units, seconds
        return max(0.0, base - sum(c * held[p] for p, c in per_unit.items())), per_unit

    def _time_cell(self, setting: DefenseSetting, spec: AttackSpec, units: dict[str, int]) -> float:
        """Seconds to share, attack and score every target batch of ``setting`` with ``units`` of its budget."""
        sc, audit = self.scenario, self.scenario.audit
        attack = sc.attack(spec, {**spec.params, **units})
        batches = [sc.target_batch(t, setting) for t in range(audit.num_batches_of(setting))]
        metrics = [audit.registry.get("metric", m) for m in audit.metrics]
        self.worker.provide_states(setting.key, lambda: {0: sc.fresh_model(sc.defense(setting), setting).state_dict()})
        start = time.perf_counter()
        read = self.worker.problems(setting, 0, [(px, lb, t, attack) for t, (px, lb) in enumerate(batches)], "")
        for rec, r in zip(solve([r.problem for r in read], audit.max_problems), read):
            score(metrics, rec.images, r.originals, rec.labels, r.labels)
        return time.perf_counter() - start

    def _probe_training(self, setting: DefenseSetting) -> tuple[float, dict[str, float]]:
        """Time the training's set-up and first steps under ``setting`` and one accuracy check: the fixed part
        (set-up and every checkpoint's check) and a step's cost."""
        sc = self.scenario
        cfg, checkpoints = sc.audit.utility, sc.audit.checkpoints
        total = max(cfg.train_steps, max(checkpoints))
        if total == 0:
            return 0.0, {"steps": 0.0}
        defense = sc.defense(setting)
        trainer = defense if cfg.train_defended else NoDefense()
        start = time.perf_counter()
        model = sc.fresh_model(defense, setting)
        steps = iter(trainer.train(model, training_run(sc, setting, total, trainer)))
        current = next(steps)
        set_up = time.perf_counter() - start
        done, began = 0, time.perf_counter()
        while done < total and (done < 2 or time.perf_counter() - began < PROBE_SECONDS):
            current = next(steps)
            done += 1
        per_step = (time.perf_counter() - began) / max(1, done)
        getattr(steps, "close", lambda: None)()  # a generator's training stops here
        began = time.perf_counter()
        accuracy(current, sc)
        checks = (time.perf_counter() - began) * (len(checkpoints) + 1)
        return set_up + checks, {"steps": per_step}


def code_of(cls: type) -> str:
    """A digest of the source file that defines ``cls``: a cost measured before the attack's code changed (a faster
    optimiser, say) is measured again, not read back; "" where the source cannot be read."""
    try:
        return hashlib.sha256(Path(inspect.getsourcefile(cls) or "").read_bytes()).hexdigest()[:16]
    except (OSError, TypeError):
        return ""


def cache_dir() -> Path:
    """Where measured costs are kept between runs, one file per machine, torch, device and thread count."""
    return cache_root() / "estimate"


def _machine_key(scenario: Scenario, threads: int) -> str:
    from leakaudit import __version__

    device = scenario.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    key = repr((platform.node(), name, os.cpu_count(), threads, torch.__version__, device.type, __version__,
                ESTIMATE_VERSION))
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _cost(entry: list[Any], problems: int = 1) -> Cost:
    """A cached cost, ``[fixed, per_unit]``, for ``problems`` target batches."""
    return Cost(float(entry[0]), {k: float(v) for k, v in entry[1].items()}, problems)


def _read(path: Path) -> dict[str, list[Any]]:
    """The cache file's costs; an unreadable one is measured again."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_workers(audit: Audit, workers: int | None = None) -> int:
    """The worker processes a fresh run of ``audit`` on this machine starts (``workers:``, else auto)."""
    given = workers or audit.workers
    if given:
        return given
    return auto_workers(audit, [*audit.settings, *tune_jobs_of(audit), *jobs_of(audit)])


def _time_start() -> float:
    """Seconds a fresh process takes to import the engine and load the registry."""
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", START_CODE], check=True, capture_output=True)
    return time.perf_counter() - began


def calibrate(scenario: Scenario, workers: int) -> Calibration:
    """Measure (or read from the cache) every cost the audit's estimate needs, under the torch threads each of its
    ``workers`` processes will have."""
    audit = scenario.audit
    threads = 1 if workers > 1 else torch.get_num_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    cal = Calibration(scenario, threads)
    spare = ThreadPoolExecutor(1)  # a fresh process's start, timed on a core the probes leave free
    beside = spare.submit(_time_start) if "start" not in cal.saved and threads < (os.cpu_count() or 1) else None
    try:
        for setting in audit.settings:
            cal.training(setting)
            for spec in audit.attacks:
                if spec.applies_to(setting):
                    cal.attack(setting, spec)
        if beside is not None:
            cal.saved["start"] = [beside.result(), {}]
        cal.start()
    finally:
        spare.shutdown(wait=False)
        torch.set_num_threads(previous)
        cal.save()
    return cal


def predict(audit: Audit, cal: Calibration, workers: int) -> Estimate:
    """The audit's wall time from measured costs: each phase's items shared among ``workers`` processes."""
    steps = {"steps": max(audit.utility.train_steps, max(audit.checkpoints))}
    training = {s.key: cal.training(s).seconds(steps) for s in audit.settings}
    tuning: dict[tuple, float] = {}
    for job in tune_jobs_of(audit):
        assert job.attack.tune is not None, "a tuning trial's attack is tuned"
        cost = cal.attack(job.setting, job.attack)
        key = (job.setting.key, job.attack.key, job.checkpoint)
        tuning[key] = tuning.get(key, 0.0) + cost.seconds(units_of(audit, job.attack, job.params),
                                                          job.attack.tune.targets)
    jobs = jobs_of(audit)
    cells: dict[tuple, float] = {}
    for one in jobs:
        key = (one.setting.key, one.attack.key, one.checkpoint)
        if key not in cells:
            cells[key] = cal.attack(one.setting, one.attack).seconds(units_of(audit, one.attack))
    sizes = Counter((j.setting.key, j.attack.key, j.checkpoint) for j in jobs)
    parts: dict[tuple, list[float]] = {}  # each stage's cells (an attack's, on defenses or references), as run
    for c in cells_of(jobs, workers, audit.registry):
        key = (c.first.setting.key, c.first.attack.key, c.first.checkpoint)
        parts.setdefault((key[1], c.first.setting.calibrates is not None), []).append(
            cells[key] * len(c.jobs) / sizes[key])
    # where verdicts settle (a budget, attacks: auto) the attacks run one after another, a step's verdict may
    # settle between them: the estimate is of the whole, an upper bound
    settles = settles_early(audit)
    attacks = (sum(_shared(p, workers) for p in parts.values()) if settles
               else _shared([s for p in parts.values() for s in p], workers))
    wall = {"start": cal.start() * (2 if workers > 1 else 1), "training": _shared(list(training.values()), workers),
            "tuning": _shared(list(tuning.values()), workers), "attacks": attacks, "report": REPORT_SECONDS}
    estimate = Estimate(workers, training, tuning, cells, wall, settles=settles)
    if audit.frontiers:
        end = audit.frontiers[0].setting(audit.frontiers[0].strong).key
        estimate.frontier_probe = training.get(end, 0.0) + sum(s for (k, _, _), s in cells.items() if k == end)
    return estimate


def _shared(seconds: list[float], workers: int) -> float:
    """Wall time of items taken largest first by whichever of ``workers`` processes is free."""
    loads = [0.0] * max(1, workers)
    for s in sorted(seconds, reverse=True):
        loads[loads.index(min(loads))] += s
    return max(loads)


def estimate_audit(audit: Audit, workers: int | None = None) -> tuple[Estimate, Calibration]:
    """The audit's estimate on this machine, its costs measured where the cache lacks them."""
    scenario = Scenario(audit)
    count = run_workers(audit, workers)
    cal = calibrate(scenario, count)
    return predict(audit, cal, count), cal


def estimate_wanted(audit: Audit | None = None) -> bool:
    """Whether to measure before work: always under ``audit``'s budget, else unless ``LEAKAUDIT_ESTIMATE=0`` (a
    test suite's many small audits, or a CI job that needs no forecast)."""
    return (audit is not None and audit.budget is not None) or os.environ.get("LEAKAUDIT_ESTIMATE", "1") != "0"


def plan_and_estimate(audit: Audit, workers: int | None = None) -> Estimate:
    """The audit's estimate; under a ``budget:`` with no plan yet, the plan is fitted and applied to ``audit``
    first, so that the estimate is of what will run."""
    estimate, cal = estimate_audit(audit, workers)
    if audit.budget is None or audit.budget_plan is not None:
        return estimate
    apply_plan(audit, fit_budget(audit, cal, estimate.workers))
    return predict(audit, cal, estimate.workers)


def fit_budget(audit: Audit, cal: Calibration, workers: int) -> dict[str, Any]:
    """The plan that fits ``audit`` into its ``budget``: attacks kept at their full budgets while they fit, the
    next scaled down to what is left (no lower than ``MIN_SHARE`` of it), the rest left out; each cut said in one
    line. Each attacker's cheapest attack comes first (cheapest first among them, each scaled so that the later ones
    keep room for ``MIN_SHARE``), so a budget that cannot run every attack still gives every threat model its
    verdict; then the rest, cheapest first. Raises ConfigError where the training and the cheapest attack cannot
    fit."""
    budget = audit.budget
    assert budget is not None, "only an audit with a budget is fitted to it"
    full = predict(audit, cal, workers)
    plan: dict[str, Any] = {"seconds": budget, "estimate": round(full.total, 1), "params": {},
                            "dropped": {}, "cut": [], "order": []}
    order = sorted(audit.attacks, key=lambda a: full.attack_seconds(a.label))
    attackers = [audit.registry.get("attack", a.name).attacker for a in order]
    firsts = [a for i, a in enumerate(order) if attackers[i] not in attackers[:i]]  # each attacker's cheapest
    order = [*firsts, *(a for a in order if a not in firsts)]
    plan["order"] = [a.label for a in order]
    if full.total <= budget:
        return plan
    attacks = list(audit.attacks)
    kept: list[AttackSpec] = []

    def total(specs: list[AttackSpec]) -> float:
        audit.attacks = specs
        try:
            return predict(audit, cal, workers).total
        finally:
            audit.attacks = attacks

    for spec in order:
        room = [_scaled_by(audit, r, MIN_SHARE) for r in firsts[firsts.index(spec) + 1:]] if spec in firsts else []
        if total([*kept, spec, *room]) <= budget:
            kept.append(spec)
            continue
        scaled = (_scaled(audit, spec, lambda s: total([*kept, s, *room]) <= budget)
                  or _scaled(audit, spec, lambda s: total([*kept, s]) <= budget))
        if scaled is not None:
            kept.append(scaled)
            plan["params"][spec.label] = scaled.params
            before, after = units_of(audit, spec), units_of(audit, scaled)
            plan["cut"].append(f"{spec.label}: " + ", ".join(f"{p} {before[p]:g} -> {after[p]:g}" for p in before))
            continue
        need = total([*kept, _scaled_by(audit, spec, MIN_SHARE)]) - total(kept)
        what = " and ".join(units_of(audit, spec)) or "budget"
        plan["dropped"][spec.label] = f"left out: it needs about {duration_text(need)} even at 1/{round(1 / MIN_SHARE)} of its {what}"
        plan["cut"].append(f"{spec.label}: {plan['dropped'][spec.label]}")
    if not kept:
        least = total([_scaled_by(audit, order[0], MIN_SHARE)])
        raise ConfigError([f"{audit.path}: budget: {duration_text(budget)} is less than the training and the "
                           f"cheapest attack ({order[0].label}) need here, about {duration_text(least)}; give at "
                           f"least {math.ceil(least / 60)}m"])
    return plan


def _scaled(audit: Audit, spec: AttackSpec, fits) -> AttackSpec | None:
    """``spec`` with its budget parameters at the largest common share of their values that ``fits`` allows, down
    to ``MIN_SHARE``; None where it has none or even that share does not fit."""
    if not budget_params(audit.registry, spec.name) or not fits(_scaled_by(audit, spec, MIN_SHARE)):
        return None
    low, high = MIN_SHARE, 1.0
    for _ in range(24):  # bisection on the share: the time grows with it
        middle = (low + high) / 2
        low, high = (middle, high) if fits(_scaled_by(audit, spec, middle)) else (low, middle)
    return _scaled_by(audit, spec, low)


def _scaled_by(audit: Audit, spec: AttackSpec, share: float) -> AttackSpec:
    """``spec`` with each budget parameter at ``share`` of its value (rounded down, at least its least value)."""
    least, full = budget_params(audit.registry, spec.name), units_of(audit, spec)
    return dataclasses.replace(spec, params={**spec.params, **{p: max(least[p], int(full[p] * share)) for p in least}})
