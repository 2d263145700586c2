"""The runner: train under each defense, then share, attack and score every job, writing rows as they land."""
from __future__ import annotations

import csv
import json
import multiprocessing
import re
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import yaml
from tqdm import tqdm

from leakaudit.plugins.attack import Reconstruction
from leakaudit.evaluator.config import Audit, AttackSpec, DefenseSetting, load_audit
from leakaudit.evaluator.metrics import score
from leakaudit.plugins.protocol import ClientStep
from leakaudit.evaluator.scenario import Scenario, check_scenario, derive_seed, generator, loss_fn, round_generators
from leakaudit.evaluator.tuning import candidates, winners
from leakaudit.evaluator.utility import privacy_spent, train_under_defense

RESULTS = "results.jsonl"
RESULTS_CSV = "results.csv"
UTILITY = "utility.jsonl"
TUNING = "tuning.jsonl"


class RunError(Exception):
    """The run cannot start or go on (one line, says what to do)."""


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

    @property
    def key(self) -> tuple:
        return (self.setting.key, self.attack.key, self.checkpoint, self.trial)


def row_key(row: dict[str, Any]) -> tuple:
    return (row["setting"], row["attack"], row["checkpoint"], row["target"])


def slug(text: str) -> str:
    """A file-name-safe, unique name for a setting key."""
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", text)[:60]
    return f"{safe}-{derive_seed(text) % 16 ** 6:06x}"


def jobs_of(audit: Audit, tuned: dict[tuple, dict] | None = None) -> list[AttackJob]:
    tuned = tuned or {}
    return [AttackJob(s, a, c, t, tuned.get((s.key, a.key, c), {}).get("params"))
            for s in audit.settings for c in audit.checkpoints for t in range(audit.num_batches) for a in audit.attacks
            if a.applies_to(s)]


def tune_jobs_of(audit: Audit) -> list[TuneJob]:
    jobs = []
    for a in (a for a in audit.attacks if a.tune is not None):
        cls = audit.registry.get("attack", a.name)
        defaults = {k: p.default for k, p in cls.params.items() if not p.required}
        trials = candidates(a.tune, a.params, defaults, derive_seed(audit.seed, "tune", a.key))
        jobs += [TuneJob(s, a, c, i, p) for s in audit.settings if a.applies_to(s) for c in audit.checkpoints
                 for i, p in enumerate(trials)]
    return jobs


class JsonlTable:
    """An append-only JSON-lines file that survives a kill mid-write (a torn last line is dropped)."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows, lines = [], self.path.read_text().splitlines()
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i != len(lines) - 1:
                    raise RunError(f"{self.path}: line {i + 1} is not JSON; the file was edited by hand") from None
                self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def append(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()


# --- work done in worker processes (or inline) -------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(audit_path: str, plugin_dirs: list[str], threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER["scenario"] = Scenario(load_audit(audit_path, plugin_dirs))


@lru_cache(maxsize=4)
def _checkpoints(path: str) -> dict[int, dict]:
    return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_file(out_dir: Path, setting: DefenseSetting) -> Path:
    return out_dir / "cache" / "train" / f"{slug(setting.key)}.pt"


def recon_file(out_dir: Path, job: AttackJob) -> Path:
    return out_dir / "cache" / "recon" / slug(job.setting.key) / f"{slug(job.attack.key)}-c{job.checkpoint}-t{job.target}.pt"


def train_job(out_dir: Path, setting: DefenseSetting) -> dict[str, Any]:
    """Train under one defense setting; save its checkpoints; return its utility row."""
    scenario: Scenario = _WORKER["scenario"]
    result = train_under_defense(scenario, setting)
    path = checkpoint_file(out_dir, setting)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({k: {n: t.cpu() for n, t in s.items()} for k, s in result.pop("states").items()}, tmp)
    tmp.replace(path)
    return result


def _attack_batch(out_dir: Path, setting: DefenseSetting, checkpoint: int, attack: Any, pixels, labels,
                  purpose: str, index: int) -> Reconstruction:
    """The defended update of one batch at one checkpoint, and the attack's reconstruction of it.

    ``purpose`` ("" for targets, "tune-" for tuning batches) and ``index`` seed the defense's noise and
    the attack's start (``round_generators``: the same for every attack and every trial of a search).
    """
    sc: Scenario = _WORKER["scenario"]
    audit, device = sc.audit, sc.device
    defense = sc.defense(setting)
    model = sc.fresh_model(defense, setting)
    model.load_state_dict(_checkpoints(str(checkpoint_file(out_dir, setting)))[checkpoint])
    model.train()
    share_gen, attack_gen = round_generators(device, audit.seed, setting.key, checkpoint, index, purpose)
    observed = defense.share(ClientStep(model, loss_fn, sc.normalise(pixels), labels, share_gen, audit.protocol))
    return attack(observed, sc.threat(model, defense, labels), attack_gen)


def tune_job(out_dir: Path, job: TuneJob) -> dict[str, Any]:
    """Score one hyperparameter setting on the tuning batches (same update and start for every trial)."""
    sc: Scenario = _WORKER["scenario"]
    metric = sc.audit.registry.get("metric", job.attack.tune.metric)
    attack, values, seconds = sc.attack(job.attack, job.params), [], 0.0
    for t in range(job.attack.tune.targets):
        pixels, labels = sc.tuning_batch(t)
        rec = _attack_batch(out_dir, job.setting, job.checkpoint, attack, pixels, labels, "tune-", t)
        values.append(score([metric], rec.images, pixels, rec.labels, labels)[0][metric.name])
        seconds += rec.seconds
    return {"setting": job.setting.key, "attack": job.attack.key, "checkpoint": job.checkpoint, "trial": job.trial,
            "params": job.params, "metric": metric.name, "score": sum(values) / len(values),
            "seconds": round(seconds, 3)}


def _epsilon(setting: DefenseSetting) -> float | None:
    """The setting's epsilon after utility training, computed once per worker."""
    cache = _WORKER.setdefault("epsilon", {})
    if setting.key not in cache:
        sc: Scenario = _WORKER["scenario"]
        cache[setting.key] = privacy_spent(sc, sc.defense(setting))
    return cache[setting.key]


def attack_job(out_dir: Path, job: AttackJob) -> tuple[dict[str, Any], list[str]]:
    """Share the defended update of one target batch, attack it and score the reconstruction."""
    sc: Scenario = _WORKER["scenario"]
    audit = sc.audit
    pixels, labels = sc.target_batch(job.target)
    rec = _attack_batch(out_dir, job.setting, job.checkpoint, sc.attack(job.attack, job.params), pixels, labels,
                        "", job.target)
    metrics = [audit.registry.get("metric", m) for m in audit.metrics]
    values, notes, order = score(metrics, rec.images, pixels, rec.labels, labels)
    path = recon_file(out_dir, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"original": pixels.cpu(), "reconstruction": rec.images[order].detach().cpu(),
                "labels": labels.cpu(), "recovered_labels": rec.labels.cpu(), "loss_trace": rec.loss_trace}, path)
    row = {"defense": job.setting.name, "setting": job.setting.key, "params": job.setting.params,
           "attack": job.attack.key, "attack_name": job.attack.name, "checkpoint": job.checkpoint,
           "target": job.target, "images": sc.target_ids(job.target).tolist(),
           "epsilon": _epsilon(job.setting), **values, "seconds": round(rec.seconds, 3)}
    if job.params is not None:
        row["attack_params"] = job.params
    return row, notes


# --- orchestration ----------------------------------------------------------------------------

def _check_out_dir(audit: Audit, out_dir: Path, resume: bool) -> None:
    saved = out_dir / "audit.yaml"
    if (out_dir / RESULTS).exists() and not resume:
        raise RunError(f"{out_dir / RESULTS} already exists; pass --resume to continue that run, or choose another --out")
    if resume and saved.exists():
        drop = lambda d: {k: v for k, v in (d or {}).items() if k != "workers"}  # noqa: E731
        if drop(yaml.safe_load(saved.read_text())) != drop(yaml.safe_load(audit.text)):
            raise RunError(f"--resume: {audit.path} differs from the audit first run in {out_dir} "
                           f"(saved as {saved}); choose another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    saved.write_text(audit.text)


def _execute(fn: Callable, items: Iterable, audit: Audit, workers: int, desc: str, progress: bool,
             on_result: Callable[[Any, Any], None]) -> None:
    """Run ``fn(item)`` for every item, in worker processes when ``workers > 1``, results in order of completion."""
    items = list(items)
    if not items:
        return
    bar = tqdm(total=len(items), desc=desc, unit="job", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    if workers <= 1:
        for item in items:
            on_result(item, fn(item))
            bar.update()
    else:
        ctx = multiprocessing.get_context("spawn")
        init = (str(audit.path), [str(d) for d in audit.plugins_dirs], 1)
        with ProcessPoolExecutor(min(workers, len(items)), mp_context=ctx, initializer=_init_worker,
                                 initargs=init) as pool:
            futures = {pool.submit(fn, item): item for item in items}
            try:
                for fut in as_completed(futures):
                    on_result(futures[fut], fut.result())
                    bar.update()
            except BaseException:  # a failed job or Ctrl-C: stop queued jobs, keep the rows already written
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    bar.close()


def run_audit(audit: Audit, out_dir: str | Path, resume: bool = False, progress: bool = True,
              workers: int | None = None) -> dict[str, Any]:
    """Run the whole audit into ``out_dir`` and write the report; returns the summary."""
    from leakaudit.evaluator.report import write_report

    out_dir = Path(out_dir)
    scenario = Scenario(audit)
    check_scenario(scenario)
    _check_out_dir(audit, out_dir, resume)
    workers = workers or audit.workers
    _WORKER["scenario"] = scenario
    notes: set[str] = set()

    utility = JsonlTable(out_dir / UTILITY)
    trained = {r["setting"] for r in utility.read()
               if (s := _setting(audit, r)) is not None and checkpoint_file(out_dir, s).exists()}
    todo = [s for s in audit.settings if s.key not in trained]
    _execute(_bind(train_job, out_dir), todo, audit, workers, "training", progress,
             lambda s, row: utility.append(row))

    tuning = JsonlTable(out_dir / TUNING)
    tried = {(r["setting"], r["attack"], r["checkpoint"], r["trial"]) for r in tuning.read()}
    _execute(_bind(tune_job, out_dir), [j for j in tune_jobs_of(audit) if j.key not in tried], audit, workers,
             "tuning", progress, lambda j, row: tuning.append(row))
    trials = tuning.read()
    tuned = winners(trials, audit.registry)

    results = JsonlTable(out_dir / RESULTS)
    finished = {row_key(r) for r in results.read()}
    pending = [j for j in jobs_of(audit, tuned) if j.key not in finished]

    csv_file = CsvTable(out_dir / RESULTS_CSV, audit.metrics)

    def on_row(job: AttackJob, out: tuple[dict, list[str]]) -> None:
        row, new_notes = out
        results.append(row)
        csv_file.append(row)
        for n in set(new_notes) - notes:
            notes.add(n)
            tqdm.write(f"warning: {n}", file=sys.stderr)

    _execute(_bind(attack_job, out_dir), pending, audit, workers, "attacks", progress, on_row)
    rows = _in_job_order(audit, results.read())
    csv_file.rewrite(rows)
    return write_report(audit, out_dir, rows, utility.read(), sorted(notes), baseline_scores(scenario), trials)


def baseline_scores(scenario: Scenario) -> dict[str, dict[str, float | None]]:
    """Scores of guesses that use no gradient: uniform noise and a flat grey image, over all targets."""
    audit = scenario.audit
    metrics = [audit.registry.get("metric", m) for m in audit.metrics if audit.registry.get("metric", m).on == "images"]
    out: dict[str, dict[str, list]] = {"random": {}, "grey": {}}
    gen = generator(scenario.device, audit.seed, "baseline")
    for t in range(audit.num_batches):
        pixels, labels = scenario.target_batch(t)
        guesses = {"random": torch.rand(pixels.shape, generator=gen, device=pixels.device),
                   "grey": torch.full_like(pixels, 0.5)}
        for name, guess in guesses.items():
            values, _, _ = score(metrics, guess, pixels, labels, labels)
            for m, v in values.items():
                out[name].setdefault(m, []).append(v)
    return {name: {m: (None if None in vs else sum(vs) / len(vs)) for m, vs in d.items()} for name, d in out.items()}


def _setting(audit: Audit, row: dict) -> DefenseSetting | None:
    return next((s for s in audit.settings if s.key == row["setting"]), None)


class _bind:
    """A picklable ``fn(out_dir, item)`` partial (spawned workers need module-level callables)."""

    def __init__(self, fn: Callable, out_dir: Path):
        self.fn, self.out_dir = fn, out_dir

    def __call__(self, item):
        return self.fn(self.out_dir, item)


def _in_job_order(audit: Audit, rows: list[dict]) -> list[dict]:
    order = {j.key: i for i, j in enumerate(jobs_of(audit))}
    return sorted((r for r in rows if row_key(r) in order), key=lambda r: order[row_key(r)])


class CsvTable:
    """``results.csv``: rows appended as they land, rewritten in job order when the run ends."""

    def __init__(self, path: Path, metrics: list[str]):
        self.path = path
        self.columns = ["defense", "setting", "params", "attack", "checkpoint", "target", "epsilon", *metrics,
                        "seconds"]

    def _write(self, rows: Iterable[dict], mode: str) -> None:
        new = mode == "w" or not self.path.exists()
        with self.path.open(mode, newline="") as fh:
            writer = csv.DictWriter(fh, self.columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            for r in rows:
                writer.writerow({**r, "params": json.dumps(r["params"], sort_keys=True)})

    def append(self, row: dict) -> None:
        self._write([row], "a")

    def rewrite(self, rows: list[dict]) -> None:
        self._write(rows, "w")
