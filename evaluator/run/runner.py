"""The runner: train under each defense, tune, then share, attack and score every job, writing rows as they
land, and the report at the end; a rerun resumes where the folder stops.
"""
from __future__ import annotations

import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from tqdm import tqdm

from leakaudit.evaluator.audit.budget import SETTLED, apply_plan, duration_text, settles_early, skipped_of
from leakaudit.evaluator.audit.jobs import Cell, cells_of, jobs_of, trial_key, tune_jobs_of
from leakaudit.evaluator.audit.seeds import generator
from leakaudit.evaluator.audit.tuning import winners
from leakaudit.evaluator.audit.frontier import most_probes, search
from leakaudit.evaluator.audit.types import Audit, FrontierSpec
from leakaudit.evaluator.results.provenance import record
from leakaudit.evaluator.results.report import judged, write_report
from leakaudit.evaluator.results.summary import calibrates
from leakaudit.evaluator.results.rows import Row
from leakaudit.evaluator.results.rundir import (ARCHITECTURE, BASELINES, CONFIRMED, FRESH, FRONTIER, RESULTS, RUN_INFO,
                                                RunError, RunFolder)
from leakaudit.evaluator.results.types import Summary
from leakaudit.evaluator.run.analysis import analyse_all
from leakaudit.evaluator.run.estimate import Estimate, plan_and_estimate
from leakaudit.evaluator.run.executors import Pool, WorkerPool, auto_workers
from leakaudit.evaluator.run.modality import Knowledge
from leakaudit.evaluator.run.scenario import Scenario, check_scenario, process_flags, untried_attacks
from leakaudit.evaluator.run.worker import AuditWorker
from leakaudit.evaluator.zoo.metrics import class_mean_guess, frequent_tokens
from leakaudit.plugins.text import IGNORE, TokenData

__all__ = ["run_audit", "rebuild_report", "report_folder", "RunError"]


def executor_for(worker: AuditWorker, workers: int | None, pending: list) -> Pool:
    """The audit's executor: worker processes on this machine, or tasks on a Ray cluster (``executor: ray``)."""
    if worker.scenario.audit.executor.name == "ray":
        from leakaudit.evaluator.run.ray_executor import RayPool

        return RayPool(worker)
    audit = worker.scenario.audit
    return WorkerPool(worker, workers or audit.workers or auto_workers(audit, pending))


def architecture(scenario: Scenario, folder: RunFolder) -> list[dict[str, Any]]:
    """The architecture analysis of every model of the audit, computed once per run folder where the audit
    shows it (none: an empty list)."""
    saved = folder.read_json(ARCHITECTURE)
    if saved is None:
        saved = analyse_all(scenario) if shows_architecture(scenario.audit) else []
        folder.write_json(ARCHITECTURE, saved)
    return saved


def shows_architecture(audit: Audit) -> bool:
    """``architecture:``, where ``auto`` means: an attack of the audit solves the layer-wise linear systems."""
    if audit.architecture != "auto":
        return bool(audit.architecture)
    return any(audit.registry.get("attack", a.name).solves_linear_systems for a in audit.attacks)


def run_info(scenario: Scenario, workers: int, where: str | None = None,
             settling: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the report's provenance box and verdicts need from this run: versions, device, chance accuracy."""
    device = scenario.device
    where = where or (f"cuda: {torch.cuda.get_device_name(device)} x {workers} process(es)" if device.type == "cuda"
             else f"cpu: {workers} worker process(es), one torch thread each" if workers > 1
             else f"cpu: one process, {torch.get_num_threads()} torch thread(s)")
    labels = scenario.data.test_y.long().cpu()
    labels = labels[labels != IGNORE]  # a language model's positions that predict nothing
    return {"versions": versions(), "device": where, "device_type": device.type,
            "deterministic": scenario.audit.deterministic or device.type != "cuda",
            "audit_file": str(scenario.audit.path.resolve()),
            "provenance": record(scenario.audit, versions()["leakaudit"], scenario.data),
            "num_classes": scenario.data.num_classes,
            "chance_accuracy": float(torch.bincount(labels).max()) / len(labels),
            "untried_attacks": untried_attacks(scenario),
            "attack_choice": list(scenario.audit.attack_choice),  # attacks: auto's, as this version chose
            **({"budget": scenario.audit.budget_plan} if scenario.audit.budget_plan is not None
               else {SETTLED: settling} if settling is not None else {})}


def versions() -> dict[str, str]:
    """The versions a run's numbers depend on, for run.json and the report's provenance box."""
    import platform

    from leakaudit import __version__

    return {"leakaudit": __version__, "torch": torch.__version__, "python": platform.python_version(),
            **{name: _version(name) for name in ("torchvision", "opacus")}}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


_TORCH_WARNED: list[str] = []  # the version warned of in this process (a Flower simulation's workers: once each)


def warn_old_torch() -> None:
    """Warn once per process, on one line, when the installed torch is older than the one leakaudit declares (an
    app's pinned dependencies, say): its numbers are not the tested ones."""
    from importlib.metadata import PackageNotFoundError, requires

    from torch.torch_version import TorchVersion

    try:
        needed = next((r for r in requires("leakaudit") or [] if r.startswith("torch") and ">=" in r), None)
    except PackageNotFoundError:
        return
    if needed is None:
        return
    wanted = needed.split(">=")[1].split(",")[0].split(";")[0].strip()
    if TorchVersion(torch.__version__) < wanted and torch.__version__ not in _TORCH_WARNED:  # torch's own ordering
        import warnings

        _TORCH_WARNED.append(torch.__version__)
        warnings.warn_explicit(f"leakaudit: torch {torch.__version__} is installed; leakaudit supports torch >= "
                               f"{wanted} and its verdicts are tested there (an app's pinned dependencies may hold "
                               "torch back)", UserWarning, "leakaudit", 0)  # no source line to print beside it


def run_audit(audit: Audit, out_dir: str | Path, resume: bool = False, progress: bool = True,
              workers: int | None = None, template: Path | None = None, estimate: Estimate | None = None) -> Summary:
    """Run the whole audit into ``out_dir`` and write the report.

    Args:
        audit: what ``load_audit`` returned.
        out_dir: the run folder: results are written there as they are produced.
        resume: go on with a folder an earlier run of the same audit left (its finished jobs are kept).
        progress: show progress bars on stderr.
        workers: processes that run attack jobs (default: the audit's ``workers``).
        template: a Jinja2 report template in place of the built-in one.
        estimate: the audit's time estimate (``estimate.plan_and_estimate``), whose phases the progress bars
            count down; under a ``budget:`` one is made (and the plan fitted) where none is given.

    Returns:
        The summary: each setting's verdict, its strongest attack's scores, the privacy-utility decision.

    Raises:
        RunError: the folder already holds a run (pass ``resume``), the run it holds is another audit's, or it
            cannot be written.

    Example:
        summary = leakaudit.run_audit(leakaudit.load_audit("configs/quickstart.yaml"), "runs/quickstart")
        print([(case.setting, case.verdict) for case in summary.worst_case])
    """
    warn_old_torch()
    restore = process_flags(audit)
    try:
        return _run(audit, out_dir, resume, progress, workers, template, estimate)
    finally:
        restore()


def _run(audit: Audit, out_dir: str | Path, resume: bool, progress: bool, workers: int | None,
         template: Path | None, estimate: Estimate | None) -> Summary:
    """``run_audit``'s work, under the audit's kernel flags."""
    started = time.perf_counter()
    scenario = Scenario(audit)
    check_scenario(scenario)
    folder = RunFolder(out_dir, audit)
    folder.prepare(resume)
    saved = (folder.read_json(RUN_INFO) or {}).get("budget") if resume else None
    if saved is not None and audit.budget_plan is None:  # a resumed run keeps the plan it started with
        apply_plan(audit, saved)
    elif audit.budget is not None and audit.budget_plan is None:
        estimate = plan_and_estimate(audit, workers)
    if not folder.has_decoys() and (decoys := scenario.decoys()) is not None:
        folder.save_decoys(*decoys)
    worker = AuditWorker(scenario, folder)
    notes: set[str] = set()

    def on_rows(cell: Cell, out: list[Row]) -> None:
        for row in out:
            folder.results.append(row.to_json())
            folder.results_csv.append(row)
            for n in set(row.notes) - notes:
                notes.add(n)
                tqdm.write(f"warning: {n}", file=sys.stderr)

    baselines = baseline_scores(scenario)  # the guesses' scores: every verdict of the run is judged against them
    trials = folder.tuning.read()
    finished = {r.key for r in folder.rows()}  # only the attack phase adds rows
    untrained = [s for s in audit.settings if s.key not in folder.trained_settings()]
    if resume:
        tqdm.write(reused_line(audit, folder.path, untrained, trials, finished, saved is not None), file=sys.stderr)
    settling = settling_for(audit, folder, resume, estimate)
    with executor_for(worker, workers, untrained + _pending_attacks(audit, trials, finished)) as pool:
        folder.start_session(run_info(scenario, pool.workers, pool.where, settling))
        _work(audit, folder, pool, progress, on_rows, clock=Countdown(estimate, started),
              settling=None if settling is None else Settling(settling, audit, folder, baselines))
        if audit.frontiers:
            _search_frontiers(scenario, folder, pool, progress, on_rows, baselines)
    if audit.frontiers:
        _confirm_frontiers(scenario, folder, workers, progress, baselines)  # its own pool, sized for its own pending work

    trials = folder.tuning.read()
    rows = _in_job_order(audit, folder.rows())
    folder.results_csv.rewrite(rows)
    folder.write_json(BASELINES, baselines)
    analysis = architecture(scenario, folder)
    info = folder.finish_session(time.perf_counter() - started)
    return write_report(folder, rows, folder.utility.read(), baselines, trials, analysis, info, template)


def _work(audit: Audit, folder: RunFolder, pool: Any, progress: bool, on_rows: Callable, stage: str = "",
          settling: "Settling | None" = None, clock: "Countdown | None" = None) -> None:
    """Whatever the run folder lacks of the audit's settings as they stand: train, tune, attack (``stage``
    prefixes the progress bars, ``clock`` adds the audit's time left to them). Where the run settles verdicts
    (``settling``: under a budget or ``attacks: auto``), the attacks run cheapest first, the defenses' before the
    references', and a step's are skipped once no further attack can change its verdict."""
    clock = clock or Countdown(None, time.perf_counter())
    trained = folder.trained_settings()
    pool.run("train", [s for s in audit.settings if s.key not in trained], f"{stage}training{clock.left('training')}",
             progress, lambda s, row: folder.utility.append(row))
    trials = folder.tuning.read()
    for step in ("scan", "grid"):  # a scanning search's grid is known once its scan has run
        tried = {trial_key(r) for r in trials}
        pool.run("tune", cells_of([j for j in tune_jobs_of(audit, trials) if j.key not in tried], pool.workers,
                                  audit.registry),
                 (f"{stage}tuning" if step == "scan" else f"{stage}tuning, refined") + clock.left("tuning"), progress,
                 lambda cell, rows: list(map(folder.tuning.append, rows)))
        trials = folder.tuning.read()
    finished = {r.key for r in folder.rows()}
    pending = [j for j in jobs_of(audit, winners(trials, audit.registry)) if j.key not in finished]
    if settling is None:
        pool.run("attack", cells_of(pending, pool.workers, audit.registry), f"{stage}attacks{clock.left('attacks')}",
                 progress, on_rows)
        return
    labels = [*settling.record["order"], *(label for label in dict.fromkeys(j.attack.key for j in pending)
                                           if label not in settling.record["order"])]  # one auto chose on resume
    stages = [(label, reference) for reference in (False, True) for label in labels
              if any(j.attack.key == label and (j.setting.calibrates is not None) == reference for j in pending)]
    for i, (label, reference) in enumerate(stages):
        mine = [j for j in pending if j.attack.key == label and (j.setting.calibrates is not None) == reference]
        now = settling.unsettled(mine)
        pool.run("attack", cells_of(now, pool.workers, audit.registry),
                 f"{stage}attacks, {label}{' on the references' if reference else ''} ({i + 1} of {len(stages)})"
                 f"{clock.left('attacks')}", progress, on_rows)


def settling_for(audit: Audit, folder: RunFolder, resume: bool, estimate: Estimate | None) -> dict[str, Any] | None:
    """The record of a run that stops a step's attacks once its verdict is settled: a budget's plan, or under
    ``attacks: auto`` the attacks' order (cheapest first, by the estimate where there is one) and the jobs
    skipped, as run.json keeps it (a resumed run keeps its own); None where every attack runs (``settles_early``: listed
    attacks, a frontier search, verdicts judged by an interval's end)."""
    if not settles_early(audit):
        return None
    if audit.budget_plan is not None:
        return audit.budget_plan
    saved = (folder.read_json(RUN_INFO) or {}).get(SETTLED) if resume else None
    if saved is not None:
        return saved
    order = sorted(audit.attacks, key=lambda a: estimate.attack_seconds(a.label)) if estimate else audit.attacks
    return {"order": [a.label for a in order], "skipped": []}


class Settling:
    """The attack jobs a run skips because their step's verdict is settled, judged from the rows written so far,
    and their record in run.json (``record``: the budget's plan, or attacks: auto's)."""

    def __init__(self, record: dict[str, Any], audit: Audit, folder: RunFolder, baselines: dict):
        self.record, self.audit, self.folder, self.baselines = record, audit, folder, baselines
        #: settings whose guarantee bounds identification: a further attack may break the bound, so never settled
        self.bounded = {s.key for s in audit.settings if s.build(audit.registry).privacy_profile() is not None}

    def unsettled(self, jobs: list) -> list:
        """``jobs`` less those that cannot change a verdict now, which are recorded as skipped; a cell begun before
        a resume is finished whatever its step's verdict (its statistics need all its targets)."""
        written = self.folder.rows()
        leaks, vouched = settled_steps(self.folder, written, self.baselines)
        leaks = {(k, c) for k, c in leaks if k not in self.bounded}
        begun = {r.cell for r in written}
        now = [j for j in jobs if (j.setting.key, j.attack.key, j.checkpoint) in begun
               or not _is_settled(self.audit, j, leaks, vouched)]
        self._record([j for j in jobs if j not in now])
        return now

    def _record(self, jobs: list) -> None:
        """Each (setting, attack, step) of ``jobs`` in the record and run.json, with why it was not run."""
        for key in dict.fromkeys((j.setting.key, j.attack.key, j.checkpoint, j.setting.calibrates is not None)
                                 for j in jobs):
            why = ("the reference already leaks individuals here, and every setting it calibrates already leaks or "
                   "has its protection vouched for" if key[3] else "its verdict here is already a leak of individuals")
            entry = [*key[:3], why]
            if entry not in self.record.setdefault("skipped", []):
                self.record["skipped"].append(entry)
        if jobs:
            info = self.folder.read_json(RUN_INFO) or {}
            info["budget" if self.record is self.audit.budget_plan else SETTLED] = self.record
            self.folder.write_json(RUN_INFO, info)


class Countdown:
    """The audit's time left, from its estimate and the time already spent, for the progress bars' labels."""

    def __init__(self, estimate: Estimate | None, started: float):
        self.estimate, self.started = estimate, started

    def left(self, phase: str) -> str:
        """`` (audit: about 3 min 10 s left)`` as ``phase`` starts; empty without an estimate."""
        if self.estimate is None:
            return ""
        phases = list(self.estimate.wall)
        ahead = sum(self.estimate.wall[p] for p in phases[phases.index(phase):])
        spent = time.perf_counter() - self.started
        before = sum(self.estimate.wall[p] for p in phases[:phases.index(phase)])
        return f" (audit: about {duration_text(max(ahead, ahead + before - spent))} left)"


def settled_steps(folder: RunFolder, written: list[Row], baselines: dict) -> tuple[set[tuple[str, int]],
                                                                                   set[tuple[str, int]]]:
    """Judged on the whole cells of ``written`` (the folder's rows so far): the (setting, step) pairs whose verdict is already a leak of
    individuals (no further attack of theirs can change it), and those that leak or whose "protects" their
    reference already vouches for (it leaks beyond the labels: no further attack on it can change their verdict)."""
    expected = Counter((j.setting.key, j.attack.key, j.checkpoint) for j in jobs_of(folder.audit))
    have = Counter(r.cell for r in written)
    rows = _in_job_order(folder.audit, [r for r in written if have[r.cell] >= expected[r.cell]])  # whole cells
    if not rows:
        return set(), set()
    summary = judged(folder, rows, folder.utility.read(), baselines, folder.read_json(RUN_INFO) or {})
    leaks = {(v.setting, v.checkpoint) for v in summary.verdicts if v.verdict == "leaks" and v.level == "individuals"}
    vouched = {(v.setting, v.checkpoint) for v in summary.verdicts  # a budget-open "protects" may need the reference's
               if v.verdict == "leaks" or (v.calibrated_by is not None and not v.budget)}  # scaled attack to stand
    return leaks, vouched


def _is_settled(audit: Audit, job: Any, leaks: set[tuple[str, int]], vouched: set[tuple[str, int]]) -> bool:
    """Whether ``job`` cannot change a verdict: its setting already leaks individuals at its step, and where it is
    an undefended reference, every setting it calibrates with this attack at that step leaks, or is vouched for."""
    if (job.setting.key, job.checkpoint) not in leaks:
        return False
    if job.setting.calibrates is None:
        return True
    return all((t.key, job.checkpoint) in vouched for t in audit.settings
               if t is not job.setting and audit.reference_of(t) is job.setting and calibrates(audit, job.attack, t))


def _search_frontiers(scenario: Scenario, folder: RunFolder, pool: Any, progress: bool, on_rows: Callable,
                      baselines: dict[str, dict[str, float | None]]) -> None:
    """Each ``frontier:`` search, its probes judged one after the other (each needs the last one's verdict);
    a probe's setting joins the audit, and frontier.json lists every probe so that a report rebuilt from the
    folder finds them. A rerun replays the search on the rows it has and continues where it stopped."""
    audit = scenario.audit
    probes: dict[str, list[float]] = {}

    def verdict_of(spec: FrontierSpec, value: float) -> str | None:
        setting = audit.add_probe(spec, value)
        probes.setdefault(spec.where, []).append(value)
        folder.write_json(FRONTIER, probes)
        _work(audit, folder, pool, progress, on_rows,
              f"frontier probe {len(probes[spec.where])} of at most {most_probes(spec)}, {setting.key}: ")
        rows = _in_job_order(audit, folder.rows())
        info = folder.read_json(RUN_INFO)  # chance accuracy, the attacks not run: what the final verdicts use
        worst = judged(folder, rows, folder.utility.read(), baselines, info).worst(setting.key)
        if progress:
            tqdm.write(f"frontier probe {len(probes[spec.where])}, {setting.key}: "
                       f"{getattr(worst, 'verdict', None) or 'not judged'}", file=sys.stderr)
        return None if worst is None else worst.verdict

    for spec in audit.frontiers:
        search(spec, lambda value: verdict_of(spec, value))


def _confirm_frontiers(scenario: Scenario, folder: RunFolder, workers: int | None, progress: bool,
                       baselines: dict[str, dict[str, float | None]]) -> None:
    """Each frontier search's chosen setting attacked again with its undefended reference, on as many targets as
    the search used, the next ones of the seeded order (none of which any probe saw), in the folder ``fresh/``:
    a choice made on the searched targets is a selection on them, and its verdict on fresh ones is the one to
    trust. Writes each choice's fresh verdict, or why there is none, to confirmed.json."""
    audit = scenario.audit
    rows = _in_job_order(audit, folder.rows())
    summary = judged(folder, rows, folder.utility.read(), baselines, folder.read_json(RUN_INFO))
    chosen = sorted({f.protecting_setting for f in summary.frontier if f.protecting_setting})
    if not chosen:
        return
    fresh = audit.on_fresh_targets(chosen)
    split = len(scenario.data.test_x if audit.data.target_split == "test" else scenario.data.train_x)
    if split < fresh.target_offset + fresh.data.targets:
        folder.write_json(CONFIRMED, {key: {"verdict": None, "reason": (
            f"not confirmed: the {audit.data.target_split} split's {split} examples leave too few for "
            f"{audit.data.targets} fresh targets beside the searched ones")} for key in chosen})
        return
    sub = RunFolder(folder.path / FRESH, fresh)
    sub.prepare(resume=True)
    _share_training(folder, sub, fresh.settings)
    again = Scenario(fresh)
    if not sub.has_decoys() and (decoys := again.decoys()) is not None:
        sub.save_decoys(*decoys)

    def on_rows(cell: Cell, out: list[Row]) -> None:
        for row in out:
            sub.results.append(row.to_json())

    finished = {r.key for r in sub.rows()}
    with executor_for(AuditWorker(again, sub), workers, [j for j in jobs_of(fresh) if j.key not in finished]) as pool:
        _work(fresh, sub, pool, progress, on_rows, "fresh targets: ")
    baselines = baseline_scores(again)
    sub.write_json(BASELINES, baselines)
    confirmed = judged(sub, _in_job_order(fresh, sub.rows()), sub.utility.read(), baselines,
                       folder.read_json(RUN_INFO))
    folder.write_json(CONFIRMED, {key: fresh_verdict(confirmed, key, fresh.data.targets) for key in chosen})


def fresh_verdict(summary: Summary, key: str, targets: int) -> dict[str, Any]:
    """A frontier choice's verdict on the fresh targets, as confirmed.json keeps it."""
    worst = summary.worst(key)
    if worst is None:
        return {"verdict": None, "targets": targets, "reason": "not confirmed: no attack could be judged on the "
                                                               "fresh targets"}
    return {"verdict": worst.verdict, "level": worst.level, "targets": targets, "attack": worst.attack,
            "score": worst.mean(summary.leakage_metric), "reason": worst.reason}


def _share_training(folder: RunFolder, sub: RunFolder, settings: list) -> None:
    """Give the fresh targets' folder the trained models of ``settings`` (their checkpoints and utility rows):
    the models are the searched ones; only the targets change."""
    have, wanted = {r["setting"] for r in sub.utility.read()}, {s.key: s for s in settings}
    for row in folder.utility.read():
        setting = wanted.get(row["setting"])
        if setting is None or row["setting"] in have:
            continue
        target = sub.checkpoint_file(setting)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder.checkpoint_file(setting), target)
        sub.utility.append(row)


def add_probes(audit: Audit, folder: RunFolder) -> None:
    """The settings the folder's frontier searches judged (frontier.json), added to the audit read from it."""
    probes = folder.read_json(FRONTIER) or {}
    for spec in audit.frontiers:
        for value in probes.get(spec.where, []):
            audit.add_probe(spec, value)


def reused_line(audit: Audit, path: Path, untrained: list, trials: list[dict], finished: set[tuple],
                planned: bool) -> str:
    """What ``--resume`` takes from the folder (trained settings, tuning trials, attack rows, the budget's plan) and
    what it has left to run, in one line."""
    jobs = [j.key for j in jobs_of(audit)]
    done = sum(key in finished for key in jobs)
    trained = len(audit.settings) - len(untrained)
    if not (trained or trials or done):
        return f"resuming {path}: nothing to reuse there; the audit runs from the start"
    plan = "; the budget's plan it started with" if planned else ""
    return (f"resuming {path}: reused {trained} of {_many(len(audit.settings), 'trained setting')}, "
            f"{_many(len(trials), 'tuning trial')} and {done} of {len(jobs)} attack jobs' rows{plan}; left: "
            f"{_many(len(untrained), 'setting')} to train and at most {_many(len(jobs) - done, 'attack job')}")


def _many(count: int, noun: str) -> str:
    """``count`` and the noun, plural but for one."""
    return f"{count} {noun}{'s' * (count != 1)}"


def _pending_attacks(audit: Audit, trials: list[dict], finished: set[tuple]) -> list:
    """The tuning trials and attack jobs a (resumed) run has left, given the trials and result rows it has, as far
    as known before it starts (a scan's refined grid and the tuned winners come later): what ``auto_workers``
    weighs."""
    tried = {trial_key(r) for r in trials}
    return ([j for j in tune_jobs_of(audit, trials) if j.key not in tried]
            + [j for j in jobs_of(audit) if j.key not in finished])


def rebuild_report(folder: RunFolder, template: Path | None = None) -> Summary:
    """Write the report of a finished run again from its folder, with no training or attack; returns the summary."""
    audit = folder.audit
    add_probes(audit, folder)
    missing = [name for name in (BASELINES, ARCHITECTURE, RUN_INFO) if not (folder.path / name).exists()]
    if (folder.path / FRESH).is_dir() and not (folder.path / CONFIRMED).exists():
        missing.append(f"{CONFIRMED}: the frontier choice's attacks on fresh targets did not finish")
    if missing or not folder.results.path.exists():
        raise RunError(f"{folder.path}: no finished run to report on (missing {', '.join(missing or [RESULTS])}); "
                       f"finish it with: leakaudit run {audit.path} --out {folder.path} --resume")
    info = folder.read_json(RUN_INFO) or {}
    plan = info.get("budget")
    if plan is not None:
        apply_plan(audit, plan)
    skipped = {tuple(s[:3]) for s in skipped_of(info)}
    rows = _in_job_order(audit, folder.rows())
    expected = sum((j.setting.key, j.attack.key, j.checkpoint) not in skipped for j in jobs_of(audit))
    if len(rows) < expected:
        raise RunError(f"{folder.path}: {len(rows)} of {expected} attack jobs finished; finish the run with: "
                       f"leakaudit run {audit.path} --out {folder.path} --resume")
    baselines, architecture = folder.read_json(BASELINES), folder.read_json(ARCHITECTURE)
    assert baselines is not None and architecture is not None, "both exist: checked above"
    return write_report(folder, rows, folder.utility.read(), baselines, folder.tuning.read(),
                        architecture, folder.read_json(RUN_INFO), template)


def report_folder(path: str | Path, config: str | None = None, plugins_dirs: Iterable[str] = (),
                  template: Path | None = None) -> Summary:
    """Rewrite a run folder's report (an audit's or a LeakMonitor's) from its saved rows: ``leakaudit report DIR``.

    Args:
        path: the run folder.
        config: a YAML file whose ``verdict:``, ``leakage_metric`` and ``name`` replace the saved audit's (the rows
            are judged again; nothing is attacked).
        plugins_dirs: drop-in folders of the plugins the run used.
        template: a Jinja2 report template in place of the built-in one.

    Returns:
        The summary, judged again from the saved rows.

    Raises:
        RunError: ``config`` is not a mapping of the keys it may set, or changes the verdict's rules of a run that
            skipped attacks once its verdicts were settled, or a saved row is not JSON.

    Example:
        summary = leakaudit.report_folder("runs/quickstart")
    """
    from leakaudit.evaluator.results.rundir import saved_audit

    folder = RunFolder(path, saved_audit(Path(path), config, plugins_dirs))
    info = folder.read_json(RUN_INFO) or {}
    if config is not None and skipped_of(info):
        ran = saved_audit(Path(path), None, plugins_dirs)
        if (ran.verdict, ran.leakage_metric) != (folder.audit.verdict, folder.audit.leakage_metric):
            raise RunError(f"{config}: verdict:, leakage_metric: the run at {path} skipped attacks once its own "
                           "verdicts were settled, so other thresholds may need their rows; rerun the audit with "
                           "these sections (or judge it with the ones it ran under)")
    return rebuild_report(folder, template)


def baseline_scores(scenario: Scenario) -> dict[str, dict[str, float | None]]:
    """Scores of guesses that use no gradient, over all targets: uniform noise, a flat grey image, the training
    split's mean image (what an attacker who knows the data's distribution guesses without looking), and each
    target's class mean from the training split given its label (what an attacker who reads the labels off the
    update guesses; the true labels, the best case of a label-recovering attacker)."""
    audit = scenario.audit
    metrics = [audit.registry.get("metric", m) for m in audit.metrics if audit.registry.get("metric", m).on == "images"]
    batches = (scenario.target_batch(t) for t in range(audit.num_batches))
    if scenario.text:  # the most frequent token at each position, and uniform draws
        assert isinstance(scenario.data, TokenData), "a text audit's examples are sentences"
        frequent = frequent_tokens(scenario.data.train_x, scenario.data.pad_id)
        return scenario.modality.guesses(metrics, batches, Knowledge(
            frequent=frequent, vocab_size=scenario.data.vocab_size, pad_id=scenario.data.pad_id,
            recall=lambda guess, t: scenario.pii_recall(guess.cpu(), scenario.target_ids(t).tolist())),
            generator("cpu", audit.seed, "baseline"))
    train_x, train_y = scenario.data.train_x.float(), scenario.data.train_y.reshape(-1)
    average = train_x.mean(dim=0).to(scenario.device)
    classes = train_y.unique()
    templates = torch.stack([train_x[train_y == c].mean(dim=0) for c in classes]).to(scenario.device)
    return scenario.modality.guesses(metrics, batches, Knowledge(
        average, lambda pixels, labels: class_mean_guess(templates, classes.to(labels.device), labels, average)),
        generator(scenario.device, audit.seed, "baseline"))


def _in_job_order(audit: Audit, rows: list[Row]) -> list[Row]:
    order = {j.key: i for i, j in enumerate(jobs_of(audit))}
    return sorted((r for r in rows if r.key in order), key=lambda r: order[r.key])
