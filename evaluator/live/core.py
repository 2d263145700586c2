"""The core every LeakMonitor shares: the audit it checks, the run folder it writes, and the attack of one update
at the weights it was computed at, beside the undefended reference that calibrates its verdict."""
from __future__ import annotations

import json
import logging
import random
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from leakaudit.evaluator.audit.checks import check_leakage_metric
from leakaudit.evaluator.audit.config import monitor_audit
from leakaudit.evaluator.audit.jobs import AttackJob
from leakaudit.evaluator.audit.seeds import generator
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.live.api import attack_shared, named_problems, prepare
from leakaudit.evaluator.results.report import judged
from leakaudit.evaluator.results.rundir import (
    ARCHITECTURE,
    BASELINES,
    MONITOR,
    VOCABULARY,
    RUN_INFO,
    RunError,
    RunFolder,
    saved_audit,
)
from leakaudit.evaluator.results.types import Summary
from leakaudit.evaluator.run.runner import warn_old_torch
from leakaudit.evaluator.run.modality import IMAGES, TEXT, Knowledge, Modality, Stats
from leakaudit.evaluator.run.scenario import round_generators
from leakaudit.evaluator.run.step import Judging, Update
from leakaudit.evaluator.zoo.metrics import class_mean_guess, frequent_tokens
from leakaudit.evaluator.zoo.text import pii_recall
from leakaudit.plugins.attack import AuxiliaryData
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import FEDSGD, ClientStep, LossFn, opacus_hooks_off, parameter_names, trainable
from leakaudit.plugins.spec import one_line
from leakaudit.plugins.text import decode_tokens


#: monitor.json's record of the run so far
RECORDED = ("steps", "fits", "rounds", "skipped", "undone", "sampled", "failed", "claimed", "secure_aggregation")
MAX_ROUND_IMAGES = 64  # a federated round over more images is attacked on a seeded sample of this many
PRIOR_SAMPLE = 256  # items of the attacker's data averaged into the mean-image guess the verdict compares with
ATTACKER_SAMPLE = 1024  # items of the attacker's data drawn for the attacks that learn from it (the first 256: the guess)
CAPTURED = "cache/monitor"  # the attacker's sample, kept for reports rebuilt without the dataset
ATTACKER_DEFAULTS = {"memory": True}  # the server keeps every update the client sent
LOGGER = logging.getLogger("leakaudit.monitor")


def monitor_logger() -> logging.Logger:
    """The monitor's logger: the application's handlers where it configured logging, else a line on stderr
    per message (as Lightning's ``lightning.pytorch`` logger does); ``setLevel(logging.WARNING)`` quiets it."""
    if not LOGGER.handlers and not logging.getLogger().hasHandlers():
        LOGGER.addHandler(logging.StreamHandler())
        LOGGER.propagate = False
    if LOGGER.level == logging.NOTSET:
        LOGGER.setLevel(logging.INFO)
    return LOGGER


@contextmanager
def own_random_state(device: torch.device) -> Iterator[None]:
    """Run the block on forked random states (torch's CPU and ``device``'s, Python's, NumPy's): whatever an
    attack or an evaluation draws, the training around it draws exactly what it would have unwatched."""
    py, npy = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


_OBSERVERS: dict[int, "MonitorCore"] = {}  # thread id -> the monitor told of every DataLoader batch it yields
_OBSERVED = threading.Lock()
_PLAIN_ITER = DataLoader.__iter__


@contextmanager
def loaders_observed(monitor: "MonitorCore") -> Iterator[None]:
    """Inside the block, every DataLoader this thread iterates tells ``monitor`` each pass and batch (as
    ``MonitoredLoader`` does for one loader): for training code that makes its loaders itself, a Flower
    ``ClientApp``'s train function say. Other threads' loaders are left alone."""
    thread = threading.get_ident()
    with _OBSERVED:
        if not _OBSERVERS:
            DataLoader.__iter__ = _observed_iter  # type: ignore[method-assign,assignment]
        _OBSERVERS[thread] = monitor
    try:
        yield
    finally:
        with _OBSERVED:
            _OBSERVERS.pop(thread, None)
            if not _OBSERVERS:
                DataLoader.__iter__ = _PLAIN_ITER  # type: ignore[method-assign]


def _observed_iter(loader: DataLoader) -> Iterator[Any]:
    batches = _PLAIN_ITER(loader)
    monitor = _OBSERVERS.get(threading.get_ident())
    return batches if monitor is None else _told(monitor, loader, batches)


def _told(monitor: "MonitorCore", loader: Any, batches: Iterator[Any]) -> Iterator[Any]:
    monitor.observe_pass(loader)
    for batch in batches:
        monitor.observe_batch(batch)
        yield batch


class MonitoredLoader:
    """The user's data loader, unchanged, telling its monitor each batch it yields."""

    def __init__(self, loader: Any, monitor: "MonitorCore") -> None:
        self._loader = loader
        self._monitor = monitor

    def __iter__(self) -> Iterator[Any]:
        self._monitor.observe_pass(self._loader)
        for batch in self._loader:
            self._monitor.observe_batch(batch)
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class MonitorCore:
    """What every LeakMonitor does, whatever drives its steps: check the audit and open the run folder, attack an
    update at the weights it was computed at (and the undefended reference beside it), write rows, baselines
    and the report. ``StepMonitor`` and ``RoundMonitor`` say which updates are attacked."""

    def __init__(self, defense: str | dict[str, Any] = "none",
                 attacks: str | Sequence[str | dict[str, Any]] = "auto", *, every: int = 100,
                 out: str | Path = "runs/monitor", mean: Stats | None = None, std: Stats | None = None,
                 loss_fn: LossFn = F.cross_entropy, known_labels: bool = False,
                 metrics: Sequence[str] | None = None, seed: int = 0, delta: float = 1e-5,
                 name: str = "monitor", plugins_dirs: Sequence[str] = (),
                 attacker: dict[str, Any] | None = None, leakage_metric: str | None = None, prior: Any = None,
                 eval_loader: Any = None, loggers: Sequence[Any] = (), vocabulary: Sequence[str] | None = None,
                 personal_values: Callable[[str], Sequence[str]] | None = None) -> None:
        problems = [] if isinstance(every, int) and every >= 1 else [f"every: {every!r}; expected a whole number >= 1"]
        problems += [] if 0 < delta < 1 else [f"delta: {delta!r}; expected a number in (0, 1)"]
        self.attacker = {**ATTACKER_DEFAULTS, **(attacker if isinstance(attacker, dict) else {})}
        problems += _attacker_problems(attacker)
        problems += [f"loggers[{i}]: a {type(sink).__name__}; expected a TensorBoard SummaryWriter (add_scalar), an "
                     "object with log_metrics(metrics, step) (Lightning's loggers, the mlflow module) or a function "
                     "(scalars, step)" for i, sink in enumerate(loggers) if _sink_kind(sink) is None]
        problems += [] if eval_loader is None or hasattr(eval_loader, "__iter__") else [
            f"eval_loader: a {type(eval_loader).__name__}; expected a loader of held-out (inputs, labels) batches"]
        items = getattr(prior, "dataset", prior)
        indexable = hasattr(items, "__getitem__") and hasattr(items, "__len__") and not isinstance(items, (str, bytes))
        problems += [] if prior is None or indexable else [
            f"prior: a {type(prior).__name__}; expected a dataset (or a loader over one) of the attacker's own "
            "(inputs, labels) items"]
        problems += [] if vocabulary is None or (not isinstance(vocabulary, str) and all(
            isinstance(w, str) for w in vocabulary)) else ["vocabulary: expected a list of strings, one per token id"]
        problems += [] if personal_values is None or callable(personal_values) else [
            f"personal_values: a {type(personal_values).__name__}; expected a function of a sentence (its tokens "
            "joined by spaces) that returns the personal values it holds"]
        problems += [] if personal_values is None or vocabulary is not None else [
            "personal_values: reads sentences in words; give vocabulary= too (the token of each id)"]
        if attacks != "auto" and (isinstance(attacks, str) or not isinstance(attacks, Sequence)):
            problems.append(f"attacks: {attacks!r}; expected auto or a list of attack names or entries")
        elif not problems:  # names and parameters now, where the monitor is made; the rest at attach
            problems += named_problems(defense, attacks, metrics, plugins_dirs)
        if problems:
            raise ConfigError([f"LeakMonitor: {p}" for p in problems])
        self.vocabulary = None if vocabulary is None else list(vocabulary)
        self.personal_values = personal_values
        self._modality: Modality = IMAGES  # text: token ids, once attached to a loop that trains on them
        self.defense = {"name": defense} if isinstance(defense, str) else defense
        self.attacks: Any = attacks if attacks == "auto" else [{"name": a} if isinstance(a, str) else a for a in attacks]
        self.every, self.out = every, Path(out)
        self.mean, self.std, self.loss_fn, self.known_labels = mean, std, loss_fn, known_labels
        self.metrics = None if metrics is None else list(metrics)  # None: live_metrics, once the plugins load
        self.seed, self.delta, self.name = seed, delta, name
        self.plugins_dirs = list(plugins_dirs)
        self.leakage_metric, self.prior, self.eval_loader = leakage_metric, prior, eval_loader
        self.loggers = list(loggers)
        self.log = monitor_logger()
        warn_old_torch()
        self.steps_taken = 0
        #: The update attacked at the last audited step, ``(theta_before - theta_after) / lr`` per parameter.
        self.last_update: list[Tensor] | None = None
        self._batch: Any = None
        self._passes = 0
        self._source: Any = None  # the loader of the last pass begun
        self._physical: list[Any] = []  # the batches since the last optimizer step (StepMonitor)
        self._attack_seconds = 0.0  # this session's, for run.json
        self._round: Any = None  # the local round being watched (rounds.LocalRound)
        self.watched: Any = None  # the loader given to ``watch``
        self.max_images = MAX_ROUND_IMAGES
        self._inner: torch.optim.Optimizer | None = None  # the hooked optimizer (StepMonitor)
        self._federated = False  # bound to federated rounds (RoundMonitor)
        self._folder: RunFolder | None = None  # once attached or bound (``folder``)
        self._dp: dict[str, Any] | None = None  # Opacus's settings, under its DPOptimizer (steps.py)
        self._pending: Any = None  # the step whose update is awaited (steps.py's record)
        self._accountant: Any = None  # Opacus's, when its PrivacyEngine made the optimizer
        self._handles: list[Any] = []
        self._model: nn.Module | None = None
        self._described: dict[str, Any] = {"steps": []}  # monitor.json, once attached
        self._sample: tuple[Tensor, Tensor] | None = None  # the attacker's data, once drawn (_attacker_sample)


    def _setup(self, model: nn.Module, dataset: Any, loader: Any, defense: Any, protocol: Any, batch_size: int,
               problems: list[str], scope: str, federated: bool = False) -> None:
        """What attaching checks and opens, whatever drives the steps: the normalisation, the input shape, the
        defense and attacks, then the run folder. Raises ConfigError, one line per problem."""
        self._model, self._dataset, self._federated = model, dataset, federated
        self._modality = TEXT if _holds_token_ids(dataset) else IMAGES
        modality = self._modality
        if not modality.normalised and (self.mean is not None or self.std is not None):
            problems.append("mean, std: the loader's items are token ids, which are not normalised; leave them out")
        if not modality.personal and self.personal_values is not None:
            problems.append("personal_values: the loader's items are images; PII recall reads a language model's "
                            "sentences: leave it out")
        stats = self._normalisation(loader, dataset, problems) if modality.normalised else ((0.0,), (1.0,))
        shape = self._input_shape(dataset, problems)
        refused: list[tuple[str, str]] = []
        with opacus_hooks_off(model) as plain:
            self._prepared = prepare(plain, defense, self.attacks, self.metrics, protocol, batch_size,
                                     modality.image_size(shape), self.plugins_dirs, problems, caller="LeakMonitor",
                                     scope=scope, modality=modality.name, refused=refused)
            self.metrics = [m.name for m in self._prepared.scorers]
        if self._prepared.choice or refused:  # attacks: auto, or those that apply, written out as a list
            self.attacks = self._prepared.attack_entries
        if self._prepared.choice:
            self.log.info("LeakMonitor: attacks: auto chose, for %s:\n  %s", scope, "\n  ".join(self._prepared.choice))
        if self.leakage_metric is not None:
            wrong: list[str] = []
            check_leakage_metric(self.leakage_metric, self.metrics, self._prepared.registry, wrong)
            if wrong:
                raise ConfigError([f"LeakMonitor: {line}" for line in wrong])
        if shape is not None:  # the first training input: a wrong normalisation caught early
            modality.attacked(torch.as_tensor(inputs_labels(dataset[0], single=True)[0]).float()[None], stats,
                              caller="LeakMonitor")
        self._stats = stats
        self._described = self._describe(plain, defense, protocol, batch_size, shape)
        self._folder = self._open_folder()
        if refused:
            self._refuse(refused)
        if self._text and self.vocabulary is not None:
            self.folder.write_json(VOCABULARY, self.vocabulary)
        # the monitored setting and the reference that calibrates it, built once: every audited step shares them
        self._defenses = [(s, s.build(self._prepared.registry).under(protocol)) for s in self.folder.audit.settings]

    @property
    def _text(self) -> bool:
        """Whether the watched loop trains on token ids (its set-up and guesses are a language model's)."""
        return self._modality is TEXT

    @property
    def folder(self) -> RunFolder:
        """The run folder, once the monitor is attached (or bound to rounds)."""
        if self._folder is None:
            raise RunError("LeakMonitor: attach the monitor (or bind it to rounds) first")
        return self._folder

    @property
    def model(self) -> nn.Module:
        """The model the monitor watches, once attached."""
        if self._model is None:
            raise RunError("LeakMonitor: attach the monitor (or bind it to rounds) first")
        return self._model

    def detach(self) -> None:
        """Remove the optimizer hooks (the model and optimizer are as they were before ``attach``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def audited_steps(self) -> list[int]:
        """The training steps attacked so far (earlier runs into the same folder included)."""
        return sorted(self._described["steps"])

    def __enter__(self) -> "MonitorCore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()
        if self.audited_steps:
            self.report()

    def observe_batch(self, batch: Any) -> None:
        """The batch the next optimizer step trains on (the loader wrapper calls this; a reference only)."""
        self._batch = batch

    def observe_pass(self, loader: Any = None) -> None:
        """A new pass over ``loader`` begins (the loader wrapper calls this): FedAvg's local epochs."""
        self._passes += 1
        self._source = loader


    def _attack_at(self, step: int, before: list[Tensor], buffers: dict[str, Tensor], update: list[Tensor],
                   batch: Any, protocol: Any) -> None:
        """Attack ``update`` with the model at the weights and buffers it was computed at, then put back the
        model's own."""
        inputs, labels = inputs_labels(batch)
        with opacus_hooks_off(self.model) as plain:
            params = trainable(plain)
            device = params[0].device
            inputs, labels = torch.as_tensor(inputs).to(device), torch.as_tensor(labels).to(device)
            if len(inputs) == 0:  # a Poisson-sampled batch can be empty: nothing to attack
                self.skip(step, "its Poisson-sampled batch is empty: no image to rebuild")
                return
            self.last_update = update
            after, now = model_state(plain)
            started = time.perf_counter()
            with own_random_state(device):
                try:
                    load_model_state(plain, before, buffers)
                    self._attack(plain, step, update, inputs, labels, protocol)
                finally:
                    load_model_state(plain, after, now)
                self._after_audit(plain, step)
            seconds = time.perf_counter() - started
            if not self._attack_seconds:  # the first audit: what each later one will cost the training
                self.log.info("LeakMonitor: auditing %s %d took %.0f s; each audited %s (every %d) costs about as "
                              "much", self._unit, step, seconds, self._unit, self.every)
            self._attack_seconds += seconds
            self.folder.finish_session(self._attack_seconds)  # the report's run time: the time spent attacking

    def record_failure(self, step: int, what: str, why: str) -> None:
        """Record that ``what`` failed at step (or round) ``step`` and why, in monitor.json's ``failed`` and as one
        log line: the training it watches goes on as unwatched."""
        self._described.setdefault("failed", {}).setdefault(str(step), []).append(f"{what}: {why}")
        if self._folder is not None:
            self.folder.write_json(MONITOR, self._described)
        self.log.warning("LeakMonitor %s %d: %s failed, recorded in monitor.json; training goes on: %s",
                         self._unit, step, what, why)

    def _refuse(self, refused: list[tuple[str, str]]) -> None:
        """Record the listed attacks that cannot apply to the watched model (label, why) as failed from the start,
        in monitor.json's ``failed`` under ``attach``, one log line each: the others attack, training goes on."""
        self._described.setdefault("failed", {})["attach"] = [f"{label}: {why}" for label, why in refused]
        self.folder.write_json(MONITOR, self._described)
        for label, why in refused:
            self.log.warning("LeakMonitor: %s; %s is not run (recorded in monitor.json); training goes on", why, label)

    def audit_safely(self, step: int, audit: Callable[[], None]) -> None:
        """Run one step's (or round's) audit; whatever it raises is recorded (``record_failure``), never passed
        to the training loop around it."""
        try:
            audit()
        except Exception as exc:
            self.record_failure(step, "the audit", one_line(exc))

    def skip(self, step: int, why: str) -> None:
        """Record that step (or round) ``step`` is not attacked and why, in monitor.json and on the log."""
        self._described.setdefault("skipped", {})[str(step)] = why
        self.folder.write_json(MONITOR, self._described)
        self.log.warning("LeakMonitor %s %d not attacked: %s", self._unit, step, why)

    @property
    def _unit(self) -> str:
        return "round" if self._federated else "step"

    def _attack(self, plain: nn.Module, step: int, update: list[Tensor], inputs: Tensor, labels: Tensor,
                protocol: Any) -> None:
        inputs = self._modality.read(inputs)
        pixels, mean, std = self._modality.attacked(inputs, self._stats, caller="LeakMonitor")
        names, n = parameter_names(plain), len(inputs)
        for setting, defense in self._defenses:
            share_gen, _ = round_generators(inputs.device, self.seed, setting.identity, step, 0)
            if self._dp is not None and setting.calibrates is not None:  # the reference: the clean gradient
                observed = defense.share(ClientStep(plain, self.loss_fn, inputs, labels, share_gen, FEDSGD))
            elif self._dp is not None:  # Opacus divided the noisy sum by the expected batch size: to the mean
                observed = SharedUpdate([u * (self._dp["expected_batch_size"] / n) for u in update], names, n,
                                        {"protocol": "fedsgd"})
            else:
                sent, public = defense.apply(update, share_gen)
                observed = SharedUpdate(sent, names, n, {"protocol": protocol.name, **public})
            what = ("the DP-SGD update (Opacus's)" if self._dp is not None and setting.calibrates is None
                    else "the undefended update" if setting.is_baseline(self._prepared.registry)
                    else f"the update under {setting.key}")
            attacks = ", ".join(a.label for a in self._prepared.specs if a.applies_to(setting))
            self.log.info("LeakMonitor %s %d: attacking %s (%d %ss) with %s ...", self._unit, step, what, n,
                          self._modality.unit, attacks)
            failed: list[tuple[Update, str]] = []
            judging = Judging(self._prepared.scorers, self._modality,
                              None if setting.calibrates is not None else self._epsilon(),
                              personal=lambda aligned, u: self._pii_recall(aligned, u.originals, plain),
                              keep=self.folder.save_reconstruction)  # one update per step: no bound to test
            results = attack_shared(
                self._prepared, setting, defense, observed, plain, self.loss_fn, pixels, labels, mean, std,
                self.known_labels, protocol, lambda: round_generators(inputs.device, self.seed, setting.identity,
                                                                      step, 0)[1], step, judging,
                self._auxiliary(pixels), failed)
            for failure, why in failed:
                self.record_failure(step, f"{failure.job.attack.label} on {setting.key}", why)
            for done in results:  # written before the next setting is attacked: a failure later loses none
                self.folder.results.append(done.row.to_json())
                self.folder.results_csv.append(done.row)
                shown = ", ".join(f"{m} {v:.3g}" for m, v in done.scores.values.items() if isinstance(v, float))
                self.log.info("  %s: %s (%.0f s)", done.update.job.attack.label, shown, done.reconstruction.seconds)
        self._described["steps"].append(step)
        self.folder.write_json(MONITOR, self._described)
        self._write_baselines()

    def _pii_recall(self, recovered: Tensor, originals: Tensor, plain: nn.Module) -> float | None:
        """The share of the personal values ``personal_values`` finds in the batch's sentences that their
        reconstructions (in the same order) hold verbatim; None without the function or where it finds none."""
        if self.personal_values is None:
            return None
        pad = getattr(plain, "pad_id", 0)
        texts = [decode_tokens(ids, self.vocabulary, pad) for ids in recovered]
        personal = [list(self.personal_values(decode_tokens(ids, self.vocabulary, pad))) for ids in originals]
        return pii_recall(texts, personal)

    def _after_audit(self, plain: nn.Module, step: int) -> None:
        """Once a step's rows are written: the held-out accuracy (``eval_loader``), the step's verdict on the log
        and its scalars sent to the loggers; a federated round's report rewritten (no call ends a client's
        training), a step's at ``report()``."""
        if self.eval_loader is not None:
            self._write_utility(plain, step)
        summary = self.report() if self._federated else self._judged()
        verdict = next((v for v in summary.verdicts if v.checkpoint == step and v.setting == self._monitored), None)
        if verdict is None:
            self.log.info("LeakMonitor %s %d: not judged (no finite %s)", self._unit, step, summary.leakage_metric)
            return
        self.log.info("LeakMonitor %s %d: %s: %s", self._unit, step, verdict.verdict or "not judged", verdict.reason)
        scalars = {f"leakaudit/{summary.leakage_metric}": verdict.score,
                   **({"leakaudit/leak_threshold": verdict.threshold} if verdict.threshold is not None else {}),
                   **({"leakaudit/leaks": float(verdict.verdict == "leaks")}
                      if verdict.verdict in ("leaks", "protects") else {}),
                   **({"leakaudit/accuracy": verdict.accuracy} if verdict.accuracy is not None else {})}
        epsilon = summary.utility.get(self._monitored)
        if epsilon is not None and epsilon.epsilon is not None:
            scalars["leakaudit/epsilon"] = epsilon.epsilon
        for sink in self.loggers:
            send_scalars(sink, scalars, step)

    def _judged(self) -> Summary:
        """The run folder's summary with every step so far judged, no report drawn."""
        folder = RunFolder(self.out, saved_audit(self.out, None, self.plugins_dirs))  # the audit of its steps so far
        return judged(folder, folder.rows(), folder.utility.read(), folder.read_json(BASELINES) or {},
                      folder.read_json(RUN_INFO) or {})

    @property
    def _monitored(self) -> str:
        """The key of the setting this monitor audits (the others are its undefended reference)."""
        return self.folder.audit.settings[0].key  # the references are added after it

    @torch.no_grad()
    def _write_utility(self, plain: nn.Module, step: int) -> None:
        """The model's accuracy on ``eval_loader`` now, kept per audited step in utility.jsonl: a model the
        defense wrecked reads "unusable", not "protects"."""
        was_training, device = plain.training, next(plain.parameters()).device
        plain.eval()
        right, seen = 0, []
        try:
            for batch in self.eval_loader:
                x, y = inputs_labels(batch)
                y = torch.as_tensor(y).to(device).reshape(-1)
                right += int((plain(torch.as_tensor(x).to(device)).argmax(dim=1) == y).sum())
                seen.append(y)
        finally:
            plain.train(was_training)
        labels = torch.cat(seen) if seen else torch.zeros(0, dtype=torch.long)
        path = self.folder.utility.path
        first: dict[str, Any] = next(iter(self.folder.utility.read()), {})
        earlier = first.get("checkpoint_accuracy") or {}
        accuracy = right / max(len(labels), 1)
        if not earlier:  # the first measure: chance (the majority class's share), below which it is unusable
            info = self.folder.read_json(RUN_INFO) or {}
            info["chance_accuracy"] = float(labels.bincount().max()) / len(labels) if len(labels) else None
            self.folder.write_json(RUN_INFO, info)
        row = {"setting": self._monitored, "accuracy": accuracy, "train_steps": self.steps_taken,
               "epsilon": self._epsilon(), "delta": self.delta, "model_changes": [],
               "checkpoint_accuracy": {**earlier, str(step): accuracy}}
        path.write_text(json.dumps(row) + "\n")


    def report(self) -> Summary:
        """Write report.html (and summary.json) from the rows so far; returns the summary."""
        from leakaudit.evaluator.run.runner import report_folder

        if not self.audited_steps:
            raise RunError(f"LeakMonitor: no step attacked yet in {self.out}; attach the monitor and train past "
                           f"step 0 (it attacks steps 0, {self.every}, {2 * self.every}, ...)")
        return report_folder(self.out, plugins_dirs=self.plugins_dirs)

    def _write_baselines(self) -> None:
        """Scores of guesses made without the update (noise, grey, the mean image of the attacker's data less
        the batch's own images, and each target's class mean from those, given its label; for text, uniform tokens
        and the attacker's most frequent token at each position) on every attacked batch so far: the verdict's
        bar."""
        folder = self.folder
        audit = folder.audit
        records = (folder.load_reconstruction(AttackJob(audit.settings[0], audit.attacks[0], step, 0))
                   for step in self.audited_steps)
        batches = [(r["original"], r["labels"]) for r in records if r is not None]
        knowledge = self._text_knowledge(batches) if self._text else self._image_knowledge()
        folder.write_json(BASELINES, self._modality.guesses([m for m in self._prepared.scorers if m.on == "images"],
                                                            batches, knowledge,
                                                            generator(torch.device("cpu"), self.seed, "baseline")))

    def _text_knowledge(self, batches: list[tuple[Tensor, Tensor]]) -> Knowledge:
        """A language model's guesses: the attacker's most frequent tokens, the model's vocabulary and padding."""
        model: Any = self._model
        pad = getattr(model, "pad_id", 0)
        vocab = getattr(model, "vocab_size", None) or int(max(int(b[0].max()) for b in batches)) + 1
        return Knowledge(frequent=self._frequent_tokens(pad), vocab_size=vocab, pad_id=pad)

    def _image_knowledge(self) -> Knowledge:
        """The mean image of the attacker's data less each batch's own images, and each target's class mean."""
        sample = self._attacker_sample()  # its first 256 items make the guesses
        prior, prior_labels = (None, None) if sample is None else (sample[0][:PRIOR_SAMPLE], sample[1][:PRIOR_SAMPLE])

        def class_means(pixels: Tensor, labels: Tensor) -> Tensor | None:
            if prior is None or prior_labels is None:
                return None
            keep = outside(prior, pixels)
            rest = prior[keep].mean(dim=0) if keep.any() else None  # mean_without's, from the same mask
            return class_mean_guess(prior[keep], prior_labels[keep], labels.cpu(), rest)

        return Knowledge(lambda pixels: mean_without(prior, pixels), class_means)

    def _frequent_tokens(self, pad_id: int) -> Tensor:
        """The most frequent token at each position among up to 256 seeded sequences the attacker may hold
        (``prior``, else the training set): a guess made without the update."""
        sample = self._attacker_sample()
        assert sample is not None, "a text loop's training set is indexable (_holds_token_ids)"
        return frequent_tokens(sample[0][:PRIOR_SAMPLE], pad_id)

    def _auxiliary(self, attacked: Tensor) -> AuxiliaryData | None:
        """The attacker's own data for the attacks that learn from it (``ThreatModel.auxiliary``), as an audit
        gives them: the seeded sample of ``prior`` (else the training set) less the attacked batch's own items;
        None where nothing else is left."""
        sample = self._attacker_sample()
        if sample is None:
            return None
        keep = outside(sample[0], attacked)
        return AuxiliaryData(sample[0], sample[1], keep.nonzero().flatten()) if keep.any() else None

    def _attacker_sample(self) -> tuple[Tensor, Tensor] | None:
        """Up to ``ATTACKER_SAMPLE`` seeded items of the data the attacker may hold (``prior``, else the training
        set) as the attacks see them (pixels in [0, 1], or token ids) with their labels, on the CPU: drawn once and
        kept in the run folder (the first ``PRIOR_SAMPLE`` make the mean-image guess); None without an indexable
        dataset."""
        path = self.out / CAPTURED / "attacker.pt"
        if self._sample is None and path.exists():
            saved = torch.load(path, weights_only=True)
            self._sample = saved["inputs"], saved["labels"]
        if self._sample is not None:
            return self._sample
        source = self.prior if self.prior is not None else self._dataset
        source = getattr(source, "dataset", source)
        if source is None or not hasattr(source, "__len__") or not hasattr(source, "__getitem__") or not len(source):
            return None
        gen = generator(torch.device("cpu"), self.seed, "mean_image")
        picks = torch.randperm(len(source), generator=gen)[:ATTACKER_SAMPLE].tolist()
        items = [inputs_labels(source[i], single=True) for i in picks]
        x = torch.stack([torch.as_tensor(i).cpu() for i, _ in items])
        labels = torch.stack([torch.as_tensor(label).long().cpu() for _, label in items])
        x = self._modality.seen(x, self._stats)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"inputs": x, "labels": labels}, path)
        self._sample = x, labels
        return self._sample

    def _epsilon(self) -> float | None:
        """Epsilon at ``delta`` spent so far (this step included) under Opacus: from the accountant its
        PrivacyEngine was given (the figure it prints), else from an RDP accountant over the steps taken."""
        if self._dp is None:
            return None
        if self._accountant is not None:
            return float(self._accountant.get_epsilon(self.delta))
        if self._dp["sample_rate"] is None:
            return None
        defense = self._prepared.defenses[0][1]
        return defense.privacy_spent(self.steps_taken, self._dp["sample_rate"], self.delta)

    def _normalisation(self, loader: Any, dataset: Any, problems: list[str]) -> tuple[Stats, Stats]:
        found = find_normalize(loader if loader is not None else dataset)
        if self.mean is not None and self.std is not None:
            if found is not None and not (_same(self.mean, found.mean) and _same(self.std, found.std)):
                problems.append(f"mean, std: {self.mean}, {self.std} differ from the loader's Normalize "
                                f"(mean={list(found.mean)}, std={list(found.std)}); leave them out to use the loader's")
            return self.mean, self.std
        if (self.mean is None) != (self.std is None):
            problems.append("mean, std: give both or neither")
        elif found is not None:
            return tuple(found.mean), tuple(found.std)
        else:
            problems.append("mean, std: the loader applies no torchvision Normalize to read them from, and "
                            "leakaudit will not guess; pass mean= and std= (mean=0, std=1 for raw pixels in [0, 1])")
        return 0.0, 1.0

    def _input_shape(self, dataset: Any, problems: list[str]) -> tuple[int, ...] | None:
        """One training input's shape (C, H, W), or (T,) of token ids, read from the dataset's first item; None
        when it has none."""
        if dataset is None or not hasattr(dataset, "__getitem__") or not len(dataset):
            return None
        shape = tuple(torch.as_tensor(inputs_labels(dataset[0], single=True)[0]).shape)
        problem = self._modality.item_problem(shape)
        problems += [] if problem is None else [problem]
        return shape if problem is None else None

    def _describe(self, plain: nn.Module, defense: Any, protocol: Any, batch_size: int,
                  shape: tuple | None) -> dict[str, Any]:
        """``monitor.json``: what ``monitor_audit`` rebuilds this monitor's audit from. Federated rounds add the
        rounds taken part in (``fits``) and each audited round's local training (``rounds``, ``protocol``)."""
        rounds = {"fits": 0, "rounds": {}, "skipped": {}, "protocol": protocol.name} if self._federated else {}
        return rounds | {"name": self.name, "seed": self.seed, "data": "the training loop's batches (LeakMonitor)",
                "model": type(plain).__name__, "mode": "train" if plain.training else "eval",
                "image_size": self._modality.image_size(shape) or 32, "batch_size": batch_size,
                **self._modality.described(plain),
                "defense": defense, "attacks": self.attacks, "metrics": self.metrics,
                "known_labels": self.known_labels, "delta": self.delta, "every": self.every, "attacker": self.attacker,
                "leakage_metric": self.leakage_metric,
                "dropout": sorted({float(m.p) for m in plain.modules()
                                   if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0}),
                "device": next(plain.parameters()).device.type, "dp": self._dp, "steps": []}

    def _open_folder(self) -> RunFolder:
        """The run folder: a new one, or the same monitor's earlier run continued (its audited steps skipped)."""
        path, described = self.out, self._described
        saved = path / MONITOR
        if saved.is_file():
            earlier = json.loads(saved.read_text())
            if _settings(earlier) != _settings(described):
                raise ConfigError([f"LeakMonitor: out: {path} holds a monitor run with other settings; choose "
                                   "another out"])
            described.update({k: earlier[k] for k in RECORDED if k in earlier})
        elif path.exists() and any(path.iterdir()):
            raise ConfigError([f"LeakMonitor: out: {path} is not empty and holds no monitor run; choose another out"])
        path.mkdir(parents=True, exist_ok=True)
        audit = monitor_audit(json.loads(json.dumps(described)), saved, self.plugins_dirs, self._prepared.registry)
        folder = RunFolder(path, audit)
        folder.write_json(MONITOR, described)
        if not (path / ARCHITECTURE).exists():
            folder.write_json(ARCHITECTURE, [])
        from leakaudit.evaluator.run.runner import versions

        device = next(self.model.parameters()).device.type
        folder.start_session({"versions": versions(), "device": f"{device}: inside the training process (LeakMonitor)",
                              "device_type": device, "deterministic": True, "audit_file": str(saved),
                              "chance_accuracy": None})
        return folder


def _holds_token_ids(dataset: Any) -> bool:
    """Whether the training items are token ids (one integer sequence each): a language model's loop, audited as
    text. An integer image (C, H, W) is not."""
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__") or not len(dataset):
        return False
    x = torch.as_tensor(inputs_labels(dataset[0], single=True)[0])
    return x.dim() == 1 and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool


def mean_without(prior: Tensor | None, pixels: Tensor) -> Tensor | None:
    """The mean image of ``prior``'s items that are none of ``pixels``' images: a guess made without the update
    must not be handed the very images it is scored against (a client of one image, say); None when none is left."""
    if prior is None:
        return None
    keep = outside(prior, pixels)
    return prior[keep].mean(dim=0) if keep.any() else None


def outside(items: Tensor, attacked: Tensor) -> Tensor:
    """Which of ``items`` (CPU) are none of the ``attacked`` ones (the same pixels within 1e-5, or token ids)."""
    keep = torch.ones(len(items), dtype=torch.bool)
    flat = items.flatten(1).float()
    for item in attacked.detach().cpu().flatten(1).float():
        keep &= (flat - item).abs().amax(dim=1) > 1e-5
    return keep


def _sink_kind(sink: Any) -> str | None:
    """How scalars reach ``sink``: TensorBoard's ``add_scalar``, a ``log_metrics`` (Lightning, MLflow), a call."""
    if hasattr(sink, "add_scalar"):
        return "add_scalar"
    if hasattr(sink, "log_metrics"):
        return "log_metrics"
    return "call" if callable(sink) else None


def send_scalars(sink: Any, scalars: dict[str, float], step: int) -> None:
    """Send one audited step's scalars to a logger, each the way it takes them."""
    kind = _sink_kind(sink)
    if kind == "add_scalar":
        for key, value in scalars.items():
            sink.add_scalar(key, value, step)
    elif kind == "log_metrics":
        sink.log_metrics(scalars, step=step)
    else:
        sink(scalars, step)


def _attacker_problems(attacker: Any) -> list[str]:
    """What is wrong with a LeakMonitor's ``attacker`` mapping, one line each."""
    if attacker is None:
        return []
    if not isinstance(attacker, dict):
        return [f"attacker: {attacker!r}; expected a mapping such as {{'memory': False}}"]
    problems = [f"attacker.{k}: unknown key; choices: {', '.join(ATTACKER_DEFAULTS)}" for k in attacker
                if k not in ATTACKER_DEFAULTS]
    if not isinstance(attacker.get("memory", True), bool):
        problems.append(f"attacker.memory: {attacker['memory']!r} is not of type bool; choices: true, false")
    return problems


def _settings(described: dict[str, Any]) -> dict[str, Any]:
    """A monitor.json's settings, without its record of the run so far: what a resumed monitor must match."""
    return {k: v for k, v in described.items() if k not in RECORDED}


def find_normalize(source: Any) -> Any | None:
    """The torchvision ``Normalize`` a loader's (or dataset's) transform applies, looking through ``Subset``
    and ``Compose``; None when there is none."""
    dataset = getattr(source, "dataset", source)
    seen: set[int] = set()
    while dataset is not None and id(dataset) not in seen:
        seen.add(id(dataset))
        for attr in ("transform", "transforms"):
            found = _normalize_in(getattr(dataset, attr, None))
            if found is not None:
                return found
        dataset = getattr(dataset, "dataset", None)
    return None


def _normalize_in(transform: Any, depth: int = 0) -> Any | None:
    if transform is None or depth > 8:
        return None
    if type(transform).__name__ == "Normalize" and hasattr(transform, "mean") and hasattr(transform, "std"):
        return transform
    children = list(getattr(transform, "transforms", None) or []) + [getattr(transform, "transform", None)]
    for child in children:
        found = _normalize_in(child, depth + 1)
        if found is not None:
            return found
    return None


def _same(a: Stats, b: Stats) -> bool:
    """Whether two normalisation statistics agree, a single number standing for every channel."""
    x, y = torch.as_tensor(a, dtype=torch.float64).flatten(), torch.as_tensor(b, dtype=torch.float64).flatten()
    if len(x) == 1 or len(y) == 1:
        x, y = torch.broadcast_tensors(x, y)
    return x.shape == y.shape and bool(torch.allclose(x, y, atol=1e-6))


def inputs_labels(batch: Any, single: bool = False) -> tuple[Any, Any]:
    """The inputs and labels of a ``(inputs, labels, ...)`` batch or dataset item."""
    if isinstance(batch, dict):
        inputs = next((batch[k] for k in ("inputs", "image", "img") if k in batch), None)
        return inputs, next((batch[k] for k in ("labels", "label") if k in batch), None)
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ConfigError([f"LeakMonitor: loader: a {'dataset item' if single else 'batch'} is a "
                           f"{type(batch).__name__}; expected (inputs, labels)"])
    return batch[0], batch[1]


def joined(batches: Sequence[tuple[Any, Any]]) -> tuple[Tensor, Tensor]:
    """``(inputs, labels)`` batches as one batch, in order."""
    return (torch.cat([torch.as_tensor(x) for x, _ in batches]),
            torch.cat([torch.as_tensor(y).reshape(-1) for _, y in batches]))


def model_state(model: nn.Module) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Copies of the model's trainable parameters and buffers, for ``load_model_state`` to put back."""
    return [p.detach().clone() for p in trainable(model)], {n: b.detach().clone() for n, b in model.named_buffers()}


@torch.no_grad()
def load_model_state(model: nn.Module, params: list[Tensor], buffers: dict[str, Tensor]) -> None:
    for p, value in zip(trainable(model), params):
        p.copy_(value)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
