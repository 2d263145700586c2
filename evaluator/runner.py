"""The runner: train under each defense, then share, attack and score every job, writing rows as they land.

``AuditWorker`` holds everything one audit's jobs share (its scenario, the loaded checkpoints, each
setting's epsilon); one is made per audit, in the main process or in each worker process, so
nothing is carried over from one audit to the next.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from tqdm import tqdm

from leakaudit.evaluator.analysis import analyse_all
from leakaudit.evaluator.config import Audit, DefenseSetting, load_audit
from leakaudit.evaluator.metrics import guess_scores, score
from leakaudit.evaluator.report import write_report
from leakaudit.evaluator.rundir import (
    ARCHITECTURE,
    AttackFailed,
    BASELINES,
    RESULTS,
    RUN_INFO,
    AttackJob,
    Cell,
    RunError,
    RunFolder,
    TuneJob,
    cells_of,
    describe_item,
    item_size,
    jobs_of,
    progress_bar,
    row_key,
    trial_key,
)
from leakaudit.evaluator.scenario import (
    Scenario,
    check_scenario,
    derive_seed,
    deterministic_kernels,
    generator,
    loss_fn,
    round_generators,
)
from leakaudit.evaluator.tuning import candidates, scan_best, scan_candidates, winners
from leakaudit.evaluator.utility import privacy_spent, train_under_defense
from leakaudit.evaluator.verdict import identification_bound
from leakaudit.plugins.attack import Problem, Reconstruction
from leakaudit.plugins.protocol import ClientStep
from leakaudit.plugins.spec import one_line

__all__ = ["run_audit", "rebuild_report", "report_folder", "RunError", "jobs_of", "tune_jobs_of", "AuditWorker"]


def tune_jobs_of(audit: Audit, tried: list[dict] = ()) -> list[TuneJob]:
    """Every tuning trial known so far: a scanning search's grid trials appear once ``tried`` (the tuning
    rows) holds its whole scan."""
    jobs = []
    for a in (a for a in audit.attacks if a.tune is not None):
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


class AuditWorker:
    """One audit's jobs: training, tuning trials and attacks, with the caches they share."""

    def __init__(self, scenario: Scenario, folder: RunFolder):
        self.scenario = scenario
        self.folder = folder
        self._states: dict[str, dict[int, dict]] = {}
        self._epsilon: dict[str, float | None] = {}
        self._bound: dict[str, float | None] = {}

    def train(self, setting) -> dict[str, Any]:
        """Train under one defense setting; save its checkpoints; return its utility row."""
        result = train_under_defense(self.scenario, setting)
        self.folder.save_checkpoints(setting, result.pop("states"))
        return result

    def _states_of(self, setting) -> dict[int, dict]:
        if setting.key not in self._states:
            self._states = {setting.key: torch.load(self.folder.checkpoint_file(setting), map_location="cpu",
                                                    weights_only=True)}  # one setting at a time: bounded memory
        return self._states[setting.key]

    def provide_states(self, setting_key: str, fetch: Callable[[], dict[int, dict]]) -> None:
        """Hold a setting's checkpoints fetched from elsewhere than the run folder (a Ray task: from the object
        store); ``fetch`` is called only when this worker does not hold them already."""
        if setting_key not in self._states:
            self._states = {setting_key: fetch()}

    def epsilon(self, setting) -> float | None:
        """The setting's epsilon after utility training."""
        if setting.key not in self._epsilon:
            self._epsilon[setting.key] = privacy_spent(self.scenario, self.scenario.defense(setting))
        return self._epsilon[setting.key]

    def bound(self, setting) -> float | None:
        """The most any attack can identify of the audit's targets (a guess names an update's images: batch size
        in the number of targets) under the setting's privacy guarantee for one update; None where it gives none."""
        if setting.key not in self._bound:
            data = self.scenario.audit.data
            self._bound[setting.key] = identification_bound(self.scenario.defense(setting).privacy_profile(),
                                                            data["batch_size"], data["targets"])
        return self._bound[setting.key]

    def problems(self, setting, checkpoint: int, batches: list[tuple], purpose: str) -> tuple[
            list[Problem], list[Tensor]]:
        """The defended update of each ``(pixels, labels, index, attack)`` batch at one checkpoint, as problems,
        and the images each update was computed on (the pixels, or their augmentations under ATS): the
        originals a reconstruction is scored against.

        The model is built and loaded once, so the problems share it (and vectorised attacks solve them
        together). ``purpose`` ("" for targets, "tune-" for tuning batches) and ``index`` seed the defense's
        noise and the attack's start (``round_generators``: the same for every attack and every trial).
        """
        sc = self.scenario
        defense = sc.defense(setting)
        model = sc.fresh_model(defense, setting)
        model.load_state_dict(self._states_of(setting)[checkpoint])
        model.train(sc.model_section(setting)["mode"] == "train")
        shared: dict[int, tuple] = {}
        out, originals = [], []
        for pixels, labels, index, attack in batches:
            share_gen, attack_gen = round_generators(sc.device, sc.audit.seed, setting.identity, checkpoint, index, purpose)
            if index not in shared:  # every trial of a search attacks the same update of a batch
                pixels = defense.augment(pixels, share_gen)
                step = ClientStep(model, loss_fn, sc.normalise(pixels), labels, share_gen, sc.audit.protocol)
                shared[index] = (defense.share(step), sc.threat(model, defense, labels), pixels)
            update, threat, pixels = shared[index]
            out.append(Problem(update, threat, attack_gen, attack))
            originals.append(pixels)
        return out, originals

    def tune(self, cell: Cell) -> list[dict[str, Any]]:
        """Every trial of one search, each on the tuning batches, solved together; a row per trial."""
        sc, first = self.scenario, cell.first
        spec = first.attack.tune
        metric = sc.audit.registry.get("metric", spec.metric)
        batches = [sc.tuning_batch(t) for t in range(spec.targets)]
        attacks = [sc.attack(job.attack, job.params) for job in cell.jobs]
        problems, originals = self.problems(first.setting, first.checkpoint, [
            (*batches[t], t, attack) for attack in attacks for t in range(spec.targets)], "tune-")
        recs = _reconstruct(sc.audit, first, attacks[0], problems, "tuning")
        rows = []
        for j, job in enumerate(cell.jobs):
            mine = slice(j * spec.targets, (j + 1) * spec.targets)
            values = [score([metric], r.images, px, r.labels, lb).values[metric.name]
                      for r, px, (_, lb) in zip(recs[mine], originals[mine], batches)]
            rows.append({"setting": job.setting.key, "attack": job.attack.key, "checkpoint": job.checkpoint,
                         "trial": job.trial, "stage": job.stage, "params": job.params, "metric": metric.name,
                         "score": sum(values) / len(values), "seconds": round(sum(r.seconds for r in recs[mine]), 3)})
        return rows

    def attack(self, cell: Cell) -> list[tuple[dict[str, Any], list[str]]]:
        """Share the defended update of each target batch of one cell, attack them together, score each."""
        sc, first = self.scenario, cell.first
        audit = sc.audit
        attack = sc.attack(first.attack, first.params)
        batches = [sc.target_batch(job.target) for job in cell.jobs]
        problems, originals = self.problems(first.setting, first.checkpoint,
                                            [(px, lb, job.target, attack) for (px, lb), job in zip(batches, cell.jobs)], "")
        recs = _reconstruct(audit, first, attack, problems, f"{len(cell.jobs)} target batch(es)")
        metrics = [audit.registry.get("metric", m) for m in audit.metrics]
        return [self._row(job, px, lb, rec, metrics)
                for job, px, (_, lb), rec in zip(cell.jobs, originals, batches, recs)]

    def _row(self, job: AttackJob, pixels, labels, rec: Reconstruction, metrics) -> tuple[dict[str, Any], list[str]]:
        """Score one reconstruction, keep it for the report, and make its results row."""
        scores = score(metrics, rec.images, pixels, rec.labels, labels)
        row = self.folder.save_result(job, pixels, labels, rec, scores, self.scenario.target_ids(job.target).tolist(),
                                      self.epsilon(job.setting), self.bound(job.setting))
        return row, scores.notes


def _reconstruct(audit: Audit, job, attack, problems: list[Problem], what: str) -> list[Reconstruction]:
    """The attack's reconstructions of ``problems``; an attack that raises is an AttackFailed naming it, its
    origin and the job, on one line."""
    try:
        return type(attack).reconstruct_all(problems, audit.max_problems)
    except Exception as exc:
        origin = audit.registry.entries["attack"][job.attack.name].origin
        raise AttackFailed(f"attack {job.attack.key!r} ({origin}) failed on {job.setting.key}, step {job.checkpoint} "
                           f"({what}): {one_line(exc)}; the rows already written "
                           "are kept: fix it and rerun with --resume") from None


# --- worker processes ------------------------------------------------------------------------
# A spawned process runs the jobs of one audit: the pool's initializer builds its AuditWorker.

_PROCESS_WORKER: AuditWorker | None = None


def _init_process(audit_path: str, plugin_dirs: list[str], out_dir: str, threads: int, started) -> None:
    """Build this process's AuditWorker; on CUDA, the n-th process started takes the n-th visible GPU."""
    global _PROCESS_WORKER
    _die_with_parent()
    torch.set_num_threads(threads)
    audit = load_audit(audit_path, plugin_dirs)
    deterministic_kernels(audit)
    with started.get_lock():
        index, started.value = started.value, started.value + 1
    if audit.torch_device().type == "cuda":
        torch.cuda.set_device(index % torch.cuda.device_count())  # "cuda" now means this process's GPU
    _PROCESS_WORKER = AuditWorker(Scenario(audit), RunFolder(out_dir, audit))


def _die_with_parent() -> None:
    """End this worker as soon as the process that started it is gone (killed, even by SIGKILL), so no
    worker finishes a queued job or writes into the run folder after its run has stopped."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="leakaudit-parent-watch").start()


def _in_process(method: str, item: Any) -> Any:
    return getattr(_PROCESS_WORKER, method)(item)


class WorkerPool:
    """The run's worker processes: spawned on first use and shared by training, tuning and attacks, so a
    run pays for starting them (imports, the audit, the data) once. One worker runs jobs in this process."""

    def __init__(self, worker: AuditWorker, workers: int):
        self.worker, self.workers = worker, workers
        self.where: str | None = None  # run_info's description of the device
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is None:
            return
        if exc[0] is not None:  # a failed job, Ctrl-C or SIGTERM: stop the workers now, mid-job
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.terminate()
        self._pool.shutdown(wait=exc[0] is None, cancel_futures=exc[0] is not None)

    def _processes(self) -> ProcessPoolExecutor:
        if self._pool is None:
            audit = self.worker.scenario.audit
            ctx = multiprocessing.get_context("spawn")
            init = (str(audit.path), [str(d) for d in audit.plugins_dirs], str(self.worker.folder.path), 1,
                    ctx.Value("i", 0))
            self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_process, initargs=init)
        return self._pool

    def run(self, method: str, items: Iterable, desc: str, progress: bool,
            on_result: Callable[[Any, Any], None]) -> None:
        """``worker.<method>(item)`` for every item, results handed to ``on_result`` in order of completion."""
        items = list(items)
        if not items:
            return
        bar = progress_bar(items, desc, progress)
        if self.workers <= 1:
            for item in items:
                on_result(item, getattr(self.worker, method)(item))
                bar.update(item_size(item))
        else:
            pool = self._processes()
            futures: dict = {}
            try:
                for item in items:
                    futures[pool.submit(_in_process, method, item)] = item
                for fut in as_completed(futures):
                    try:
                        result = fut.result()
                    except BrokenProcessPool:
                        raise _worker_lost(f"{desc} ({describe_item(futures[fut])})") from None
                    on_result(futures[fut], result)
                    bar.update(item_size(futures[fut]))
            except BrokenProcessPool:  # broken before any result came back (a worker failed to start)
                raise _worker_lost(desc) from None
            except BaseException:  # a failed job or Ctrl-C: stop queued jobs, keep the rows already written
                for fut in futures:
                    fut.cancel()
                raise
        bar.close()


def _pool(worker: AuditWorker, workers: int | None, pending: list) -> "WorkerPool":
    """The audit's executor: worker processes on this machine, or tasks on a Ray cluster (``executor: ray``)."""
    if worker.scenario.audit.executor["name"] == "ray":
        from leakaudit.evaluator.ray_executor import RayPool

        return RayPool(worker)
    audit = worker.scenario.audit
    return WorkerPool(worker, workers or audit.workers or auto_workers(audit, pending))


def available_cores() -> int:
    """Cores this process may use: its CPU affinity where the OS reports one (Linux), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


#: Attack iterations (summed over a cell's targets) or training steps that pay for a worker process's start:
#: about 3 s of imports and loading, some 700 iterations of LeNet at 32 px on one core.
PROCESS_WORTH = 2000


def auto_workers(audit: Audit, pending: list) -> int:
    """``workers: auto`` on the CPU: one process per core, but no more than the pending items (settings to
    train, cells to attack) nor than their summed work pays starts for; one process's threads serve a single
    cell better than its targets cut across processes."""
    work: dict[Any, int] = {}
    for item in pending:
        if isinstance(item, DefenseSetting):
            work[item.key] = audit.utility["train_steps"]
        else:
            cls = audit.registry.get("attack", item.attack.name)
            params = {k: p.default for k, p in cls.params.items() if not p.required} | (item.params or item.attack.params)
            key = (item.setting.key, item.attack.key, item.checkpoint)
            work[key] = work.get(key, 0) + int(params.get("iterations", 1)) * int(params.get("restarts", 1))
    items = sum(w > 0 for w in work.values())
    return max(1, min(available_cores(), items, sum(work.values()) // PROCESS_WORTH))


def _worker_lost(during: str) -> RunError:
    """A worker process that died (the system's out-of-memory killer) or failed to start, as one line."""
    return RunError(f"a worker process died or failed to start during {during}: killed by the system (out of "
                    "memory?) or stopped by an error printed above; the rows already written are kept: rerun with "
                    "--resume, with a smaller max_problems: or fewer --workers")


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


def run_info(scenario: Scenario, workers: int, where: str | None = None) -> dict[str, Any]:
    """What the report's provenance box and verdicts need from this run: versions, device, chance accuracy."""
    device = scenario.device
    where = where or (f"cuda: {torch.cuda.get_device_name(device)} x {workers} process(es)" if device.type == "cuda"
             else f"cpu: {workers} worker process(es), one torch thread each" if workers > 1
             else f"cpu: one process, {torch.get_num_threads()} torch thread(s)")
    labels = scenario.data.test_y.long().cpu()
    return {"versions": versions(), "device": where, "device_type": device.type,
            "deterministic": scenario.audit.deterministic or device.type != "cuda",
            "audit_file": str(scenario.audit.path.resolve()),
            "num_classes": scenario.data.num_classes,
            "chance_accuracy": float(torch.bincount(labels).max()) / len(labels)}


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


def run_audit(audit: Audit, out_dir: str | Path, resume: bool = False, progress: bool = True,
              workers: int | None = None, template: Path | None = None) -> dict[str, Any]:
    """Run the whole audit into ``out_dir`` and write the report; returns the summary."""
    restore = deterministic_kernels(audit)
    try:
        return _run(audit, out_dir, resume, progress, workers, template)
    finally:
        restore()


def _run(audit: Audit, out_dir: str | Path, resume: bool, progress: bool, workers: int | None,
         template: Path | None) -> dict[str, Any]:
    """``run_audit``'s work, under the audit's kernel flags."""
    started = time.perf_counter()
    scenario = Scenario(audit)
    check_scenario(scenario)
    folder = RunFolder(out_dir, audit)
    folder.prepare(resume)
    worker = AuditWorker(scenario, folder)
    notes: set[str] = set()

    def on_rows(cell: Cell, out: list[tuple[dict, list[str]]]) -> None:
        for row, new_notes in out:
            folder.results.append(row)
            folder.results_csv.append(row)
            for n in set(new_notes) - notes:
                notes.add(n)
                tqdm.write(f"warning: {n}", file=sys.stderr)

    trained = folder.trained_settings()
    untrained = [s for s in audit.settings if s.key not in trained]
    with _pool(worker, workers, untrained + _pending_attacks(audit, folder)) as pool:
        workers = pool.workers
        folder.start_session(run_info(scenario, workers, pool.where))
        pool.run("train", untrained, "training", progress, lambda s, row: folder.utility.append(row))

        trials = folder.tuning.read()
        for stage in ("scan", "grid"):  # a scanning search's grid is known once its scan has run
            tried = {trial_key(r) for r in trials}
            pool.run("tune", cells_of([j for j in tune_jobs_of(audit, trials) if j.key not in tried], workers),
                     "tuning" if stage == "scan" else "tuning, refined", progress,
                     lambda cell, rows: [folder.tuning.append(row) for row in rows])
            trials = folder.tuning.read()

        finished = {row_key(r) for r in folder.results.read()}
        pending = [j for j in jobs_of(audit, winners(trials, audit.registry)) if j.key not in finished]
        pool.run("attack", cells_of(pending, workers), "attacks", progress, on_rows)


    rows = _in_job_order(audit, folder.results.read())
    folder.results_csv.rewrite(rows)
    baselines = baseline_scores(scenario)
    folder.write_json(BASELINES, baselines)
    analysis = architecture(scenario, folder)
    info = folder.finish_session(time.perf_counter() - started)
    return write_report(folder, rows, folder.utility.read(), baselines, trials, analysis, info, template)


def _pending_attacks(audit: Audit, folder: RunFolder) -> list:
    """The tuning trials and attack jobs a (resumed) run has left, as far as known before it starts (a scan's
    refined grid and the tuned winners come later): what ``auto_workers`` weighs."""
    trials = folder.tuning.read()
    tried, finished = {trial_key(r) for r in trials}, {row_key(r) for r in folder.results.read()}
    return ([j for j in tune_jobs_of(audit, trials) if j.key not in tried]
            + [j for j in jobs_of(audit) if j.key not in finished])


def rebuild_report(folder: RunFolder, template: Path | None = None) -> dict[str, Any]:
    """Write the report of a finished run again from its folder, with no training or attack; returns the summary."""
    audit = folder.audit
    missing = [name for name in (BASELINES, ARCHITECTURE, RUN_INFO) if not (folder.path / name).exists()]
    if missing or not folder.results.path.exists():
        raise RunError(f"{folder.path}: no finished run to report on (missing {', '.join(missing or [RESULTS])}); "
                       f"finish it with: leakaudit run {audit.path} --out {folder.path} --resume")
    rows = _in_job_order(audit, folder.results.read())
    expected = len(jobs_of(audit))
    if len(rows) < expected:
        raise RunError(f"{folder.path}: {len(rows)} of {expected} attack jobs finished; finish the run with: "
                       f"leakaudit run {audit.path} --out {folder.path} --resume")
    return write_report(folder, rows, folder.utility.read(), folder.read_json(BASELINES), folder.tuning.read(),
                        folder.read_json(ARCHITECTURE), folder.read_json(RUN_INFO), template)


def report_folder(path: str | Path, config: str | None = None, plugins_dirs: Iterable[str] = (),
                  template: Path | None = None) -> dict[str, Any]:
    """``leakaudit report DIR``: rewrite a run folder's report (an audit's or a LeakMonitor's) from its saved
    rows; returns the summary."""
    from leakaudit.evaluator.rundir import saved_audit

    return rebuild_report(RunFolder(path, saved_audit(Path(path), config, plugins_dirs)), template)


def baseline_scores(scenario: Scenario) -> dict[str, dict[str, float | None]]:
    """Scores of guesses that use no gradient, over all targets: uniform noise, a flat grey image, and the
    training split's mean image (what an attacker who knows the data's distribution guesses without looking)."""
    audit = scenario.audit
    metrics = [audit.registry.get("metric", m) for m in audit.metrics if audit.registry.get("metric", m).on == "images"]
    average = scenario.data.train_x.float().mean(dim=0).to(scenario.device)
    return guess_scores(metrics, (scenario.target_batch(t) for t in range(audit.num_batches)), average,
                        generator(scenario.device, audit.seed, "baseline"))


def _in_job_order(audit: Audit, rows: list[dict]) -> list[dict]:
    order = {j.key: i for i, j in enumerate(jobs_of(audit))}
    return sorted((r for r in rows if row_key(r) in order), key=lambda r: order[row_key(r)])
