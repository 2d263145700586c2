"""Audit your own training as it runs: attach once, as Opacus's ``make_private`` does, and leave the loop as it is.

``LeakMonitor.attach(model, optimizer, loader)`` hooks the optimizer's step and the loader's batches. Every
``every`` steps it keeps the weights before the step and the batch it came from, and after the step attacks
the update the step really applied, ``(theta_before - theta_after) / lr`` (momentum, Adam state and weight
decay included), with the configured attacks; under an Opacus ``DPOptimizer`` that is the noised DP update,
attacked with ``dpsgd``'s likelihood. Rows, reconstructions and baselines go to a run folder as they are made,
which ``leakaudit report DIR`` renders like an audit's, leakage plotted against the training step.

Federated clients make their optimizer anew in each round: ``watch(loader)``, ``bind_rounds(model, loader)``
and ``with monitor.local_round(n): ...`` attack the round's ``theta_before - theta_after`` as FedAvg's, over
the batches the watched loader gave (``evaluator/live/flower.py`` wraps a Flower client with them).
"""
from __future__ import annotations

import dataclasses
import json
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from leakaudit.evaluator.audit.config import monitor_audit
from leakaudit.evaluator.audit.jobs import AttackJob
from leakaudit.evaluator.audit.seeds import generator
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.live.api import Stats, attack_shared, channel_stats, pixels_of, prepare
from leakaudit.evaluator.live.memory import OptimizerMemory, param_groups, recover, remember, unsupported
from leakaudit.evaluator.results.rundir import ARCHITECTURE, BASELINES, MONITOR, RunError, RunFolder
from leakaudit.evaluator.run.scenario import round_generators
from leakaudit.evaluator.zoo.metrics import guess_scores
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.protocol import FEDSGD, ClientStep, FedAvg, LossFn, opacus_hooks_off, parameter_names, trainable

RECORDED = ("steps", "fits", "rounds", "skipped", "undone")  # monitor.json's record of the run so far
MAX_ROUND_IMAGES = 64  # a federated round over more images is not attacked
MEAN_IMAGE_SAMPLE = 256  # dataset items averaged into the mean-image guess the verdict compares with
CAPTURED = "cache/monitor"  # the mean image, kept for reports rebuilt without the dataset
ATTACKER_DEFAULTS = {"memory": True}  # the server keeps every update the client sent


@dataclass
class _Pending:
    """One audited step in flight: the weights and buffers before it, the batch it came from, and the optimizer's
    state before it (None when the attacker keeps no memory, or cannot undo this optimizer)."""

    step: int
    before: list[Tensor]
    buffers: dict[str, Tensor]
    batch: Any
    memory: OptimizerMemory | None = None


@dataclass
class _RoundStep:
    """One optimizer step of an audited federated round: its batch, pass over the loader, lrs and optimizer."""

    batch: Any
    pass_index: int
    lrs: tuple[float, ...]
    optimizer: str


@dataclass
class LocalRound:
    """A federated round being watched (``LeakMonitor.local_round``). Set ``sent`` to the weights the client
    sends (a list of arrays, as the model's ``state_dict`` or its trainable parameters) when they are not the
    model's own."""

    number: int
    params: set[int]
    sent: Sequence[Any] | None = None
    before: list[Tensor] | None = None
    buffers: dict[str, Tensor] | None = None
    steps: list[_RoundStep] = field(default_factory=list)


class MonitoredLoader:
    """The user's data loader, unchanged, telling its monitor each batch it yields."""

    def __init__(self, loader: Any, monitor: "LeakMonitor") -> None:
        self._loader = loader
        self._monitor = monitor

    def __iter__(self) -> Iterator[Any]:
        self._monitor.observe_pass()
        for batch in self._loader:
            self._monitor.observe_batch(batch)
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class LeakMonitor:
    """Attack the update of every ``every``-th training step as your loop runs, and record how much leaks.

    ``defense`` and ``attacks`` take the names and mappings of an audit file's entries. ``defense`` is applied
    to the update your step made (``none``: it is attacked as it is sent); under Opacus the update is already
    DP-SGD's and the defense is ``dpsgd`` with your optimizer's noise multiplier and clipping norm.
    ``mean`` and ``std`` are your inputs' normalisation; left out, they are read from the loader's torchvision
    ``Normalize``, and a loader without one is refused rather than guessed. Results go to ``out`` as they
    are made; a monitor attached again to the same folder with the same settings skips steps already there.

    ``attacker``: ``{memory: true}`` (the default) is a server that kept every update the client sent: it undoes
    the optimizer's mixing of earlier steps (SGD's momentum, Adam's moments; ``evaluator/live/memory.py``) and attacks
    the step's own gradient. ``{memory: false}`` attacks the update alone. Every audited step is also attacked on
    the undefended update, which calibrates its verdict (a "protects" where even that does not leak is
    inconclusive).
    """

    def __init__(self, defense: str | dict[str, Any] = "none",
                 attacks: Sequence[str | dict[str, Any]] = ("inverting_gradients",), *, every: int = 100,
                 out: str | Path = "runs/monitor", mean: Stats | None = None, std: Stats | None = None,
                 loss_fn: LossFn = F.cross_entropy, known_labels: bool = False,
                 metrics: Sequence[str] | None = None, seed: int = 0, delta: float = 1e-5,
                 name: str = "monitor", plugins_dirs: Sequence[str] = (),
                 attacker: dict[str, Any] | None = None) -> None:
        problems = [] if isinstance(every, int) and every >= 1 else [f"every: {every!r}; expected a whole number >= 1"]
        problems += [] if 0 < delta < 1 else [f"delta: {delta!r}; expected a number in (0, 1)"]
        self.attacker = {**ATTACKER_DEFAULTS, **(attacker if isinstance(attacker, dict) else {})}
        problems += _attacker_problems(attacker)
        if problems:
            raise ConfigError([f"LeakMonitor: {p}" for p in problems])
        self.defense = {"name": defense} if isinstance(defense, str) else defense
        self.attacks = [{"name": a} if isinstance(a, str) else a for a in attacks]
        self.every, self.out = every, Path(out)
        self.mean, self.std, self.loss_fn, self.known_labels = mean, std, loss_fn, known_labels
        self.metrics = None if metrics is None else list(metrics)  # None: live_metrics, once the plugins load
        self.seed, self.delta, self.name = seed, delta, name
        self.plugins_dirs = list(plugins_dirs)
        self.steps_taken = 0
        #: The update attacked at the last audited step, ``(theta_before - theta_after) / lr`` per parameter.
        self.last_update: list[Tensor] | None = None
        self._batch: Any = None
        self._passes = 0
        self._attack_seconds = 0.0  # this session's, for run.json
        self._round: LocalRound | None = None
        self.watched: Any = None  # the loader given to ``watch``
        self.max_images = MAX_ROUND_IMAGES
        self._inner: torch.optim.Optimizer | None = None  # the hooked optimizer (attach); None for rounds
        self._folder: RunFolder | None = None  # once attached or bound
        self._pending: _Pending | None = None
        self._handles: list[Any] = []
        self._model: nn.Module | None = None
        self._described: dict[str, Any] = {"steps": []}  # monitor.json, once attached

    # --- attaching -------------------------------------------------------------------------------------

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any) -> tuple[nn.Module, Any, Any]:
        """Hook ``optimizer``'s steps and ``loader``'s batches; returns ``(model, optimizer, loader)`` to train
        with as before. Raises ConfigError, one line per problem, before any training step."""
        self.bind(model, optimizer, getattr(loader, "dataset", None), loader)
        return model, optimizer, MonitoredLoader(loader, self)

    def bind(self, model: nn.Module, optimizer: torch.optim.Optimizer, dataset: Any, loader: Any = None) -> None:
        """``attach`` for loops that hand the monitor each batch themselves (``observe_batch``): Lightning."""
        self.detach()
        self._inner = getattr(optimizer, "original_optimizer", optimizer)  # Opacus's DPOptimizer wraps one
        self._dp = self._dp_settings(optimizer, loader)
        why = unsupported(self._inner)
        self._undo = self.attacker["memory"] and why is None
        problems = self._unoptimised(model)
        defense = self._defense_entry(problems)
        self._setup(model, dataset, loader, defense, FEDSGD, self._batch_size(optimizer, loader), problems,
                    f"every {self.every}-th step")
        self._handles = [self._inner.register_step_pre_hook(self._before_step),
                         self._inner.register_step_post_hook(self._after_step)]
        self._described["undone"] = None if not self.attacker["memory"] else (
            f"the server undoes {type(self._inner).__name__}'s update from the updates before it" if why is None
            else f"{why}: the server attacks the raw update")
        if self.attacker["memory"] and why is not None:
            warnings.warn(f"LeakMonitor: attacker memory: {why}; the raw update is attacked", stacklevel=3)
        self._folder.write_json(MONITOR, self._described)

    def watch(self, loader: Any) -> MonitoredLoader:
        """``loader``, telling this monitor each batch and each pass: build a federated client with it, for
        ``bind_rounds`` and ``local_round`` (Flower's ``LeakAuditClient``)."""
        self.watched = loader
        return MonitoredLoader(loader, self)

    def bind_rounds(self, model: nn.Module, loader: Any, max_images: int = MAX_ROUND_IMAGES) -> None:
        """``attach`` for federated clients, whose optimizer is made anew in each round: check the audit and
        open the run folder; ``local_round`` then audits each round's update. Raises ConfigError before any
        work. ``max_images``: rounds that train on more images are not attacked (said in a warning)."""
        self.detach()
        self._inner, self._dp, self.max_images, self._undo = None, None, max_images, False
        problems = ([f"model: an Opacus {type(model).__name__}; DP-SGD inside federated rounds is not audited "
                     "yet: audit it with LeakMonitor.attach in a plain loop"] if hasattr(model, "_module") else [])
        if not isinstance(max_images, int) or max_images < 1:
            problems.append(f"max_images: {max_images!r}; expected a whole number >= 1")
        batch_size = int(getattr(loader, "batch_size", None) or 1)
        self._setup(model, getattr(loader, "dataset", None), loader, self.defense,
                    FedAvg(local_batch_size=batch_size), batch_size, problems, "each round's update", federated=True)
        self._described["undone"] = ("not needed: each round's update is its local training, attacked as FedAvg's "
                                     "(the client makes its optimizer anew each round)")
        self._folder.write_json(MONITOR, self._described)

    def _setup(self, model: nn.Module, dataset: Any, loader: Any, defense: Any, protocol: Any, batch_size: int,
               problems: list[str], scope: str, federated: bool = False) -> None:
        """What attaching checks and opens, whatever drives the steps: the normalisation, the input shape, the
        defense and attacks, then the run folder. Raises ConfigError, one line per problem."""
        self._model, self._dataset = model, dataset
        stats = self._normalisation(loader, dataset, problems)
        shape = self._input_shape(dataset, problems)
        with opacus_hooks_off(model) as plain:
            self._prepared = prepare(plain, defense, self.attacks, self.metrics, protocol, batch_size,
                                     min(shape[-2:]) if shape else None, self.plugins_dirs, problems,
                                     caller="LeakMonitor", scope=scope)
            self.metrics = [m.name for m in self._prepared.scorers]
        if shape is not None:  # the first training input, to catch a wrong normalisation before any step
            pixels_of(torch.as_tensor(_inputs_labels(dataset[0], single=True)[0]).float()[None], *stats,
                      caller="LeakMonitor")
        self._stats = stats
        self._described = self._describe(plain, defense, protocol, batch_size, shape, federated)
        self._folder = self._open_folder()
        # the monitored setting and the reference that calibrates it, built once: every audited step shares them
        self._defenses = [(s, s.build(self._prepared.registry)) for s in self._folder.audit.settings]

    def detach(self) -> None:
        """Remove the optimizer hooks (the model and optimizer are as they were before ``attach``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def audited_steps(self) -> list[int]:
        """The training steps attacked so far (earlier runs into the same folder included)."""
        return sorted(self._described["steps"])

    def __enter__(self) -> "LeakMonitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()
        if self.audited_steps:
            self.report()

    def observe_batch(self, batch: Any) -> None:
        """The batch the next optimizer step trains on (the loader wrapper calls this; a reference only)."""
        self._batch = batch

    def observe_pass(self) -> None:
        """A new pass over the loader begins (the loader wrapper calls this): FedAvg's local epochs."""
        self._passes += 1

    # --- the two hooks: all the training path pays between audited steps is one comparison ----------------

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step = self.steps_taken
        if step % self.every or step in self._described["steps"] or self._batch is None:
            return
        plain = getattr(self._model, "_module", self._model)  # under an Opacus GradSampleModule: its module
        memory = remember(self._inner, trainable(plain)) if self._undo else None
        self._pending = _Pending(step, *_state(plain), self._batch, memory)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps_taken += 1
        pending, self._pending = self._pending, None
        if pending is not None:
            self._audit(pending)

    # --- one audited step --------------------------------------------------------------------------------

    def _audit(self, pending: _Pending) -> None:
        """Attack one step's update: the step's own gradient where the server undoes the optimizer (memory), else
        ``(theta_before - theta_after) / lr`` with each parameter's own lr."""
        params = trainable(getattr(self._model, "_module", self._model))
        if pending.memory is not None:
            update = recover(pending.memory, pending.before, [p.detach() for p in params])
        else:
            lrs = [float(g["lr"]) for g in param_groups(self._inner, params)]
            update = [(b - a.detach()) / lr for b, a, lr in zip(pending.before, params, lrs)]
        self._attack_at(pending.step, pending.before, pending.buffers, update, pending.batch, FEDSGD)

    def _attack_at(self, step: int, before: list[Tensor], buffers: dict[str, Tensor], update: list[Tensor],
                   batch: Any, protocol: Any) -> None:
        """Attack ``update`` with the model at the weights and buffers it was computed at, then put back the
        model's own."""
        inputs, labels = _inputs_labels(batch)
        with opacus_hooks_off(self._model) as plain:
            params = trainable(plain)
            device = params[0].device
            inputs, labels = torch.as_tensor(inputs).to(device), torch.as_tensor(labels).to(device)
            if len(inputs) == 0:  # a Poisson-sampled batch can be empty: nothing to attack
                return
            self.last_update = update
            after, now = _state(plain)
            started = time.perf_counter()
            try:
                _load(plain, before, buffers)
                self._attack(plain, step, update, inputs, labels, protocol)
            finally:
                _load(plain, after, now)
            self._attack_seconds += time.perf_counter() - started
            self._folder.finish_session(self._attack_seconds)  # the report's run time: the time spent attacking

    def _attack(self, plain: nn.Module, step: int, update: list[Tensor], inputs: Tensor, labels: Tensor,
                protocol: Any) -> None:
        pixels, mean, std = pixels_of(inputs, *self._stats, caller="LeakMonitor")
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
            epsilon = None if setting.calibrates is not None else self._epsilon()
            results = attack_shared(
                self._prepared, setting, defense, observed, plain, self.loss_fn, pixels, labels, mean, std,
                self.known_labels, protocol, lambda: round_generators(inputs.device, self.seed, setting.identity,
                                                                      step, 0)[1])
            for spec, rec, scores in results:  # each row written at once: a crash later loses nothing
                row = self._folder.save_result(AttackJob(setting, spec, step, 0), pixels, labels, rec, scores,
                                               list(range(n)), epsilon)  # one update per step: no bound to test
                self._folder.results.append(row)
                self._folder.results_csv.append(row)
        self._described["steps"].append(step)
        self._folder.write_json(MONITOR, self._described)
        self._write_baselines()

    # --- federated rounds: the optimizer is made inside each round, so every optimizer's steps are watched -------

    @contextmanager
    def local_round(self, server_round: int | None = None) -> Iterator[LocalRound]:
        """Audit the local training inside the block as one federated round (after ``bind_rounds``).

        Rounds 1, 1 + every, ... are attacked, numbered by ``server_round``, else by this client's count of
        its rounds. The steps of any optimizer over the model's parameters are watched; the round's update,
        ``theta_before - theta_after``, is attacked as FedAvg's over the watched loader's batches in the order
        drawn. ``theta_after`` is ``LocalRound.sent`` when the block sets it (what leaves the client), else
        the model's weights. A round that FedAvg cannot describe is not attacked, and a warning says why."""
        if self._folder is None or self._inner is not None:
            raise RunError("LeakMonitor.local_round: call bind_rounds(model, loader) first")
        self._described["fits"] += 1
        number = self._described["fits"] if server_round is None else int(server_round)
        local = LocalRound(number, {id(p) for p in self._model.parameters()})
        audited = (number - 1) % self.every == 0 and number not in self._described["steps"]
        self._batch, self._round = None, local if audited else None
        handle = register_optimizer_step_pre_hook(self._round_step) if audited else None
        try:
            yield local
        finally:
            if handle is not None:
                handle.remove()
            self._round = None
        if audited:
            self._audit_round(local)
        self._folder.write_json(MONITOR, self._described)

    def _round_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before each optimizer step in an audited round: the first keeps the weights; each keeps its batch."""
        local = self._round
        groups = optimizer.param_groups
        if local is None or not any(id(p) in local.params for g in groups for p in g["params"]):
            return
        if local.before is None:
            local.before, local.buffers = _state(self._model)
        local.steps.append(_RoundStep(self._batch, self._passes, tuple(float(g["lr"]) for g in groups),
                                      _optimizer_text(optimizer)))

    def _audit_round(self, local: LocalRound) -> None:
        found = self._round_update(local)
        if isinstance(found, str):
            self._described["skipped"][str(local.number)] = found
            warnings.warn(f"LeakMonitor: round {local.number} not attacked: {found}", stacklevel=3)
            return
        protocol, batch, update, optimizer = found  # the report's protocol and targets: the last round's
        self._described["rounds"][str(local.number)] = {**dataclasses.asdict(protocol), "images": len(batch[1]),
                                                        "optimizer": optimizer}
        self._attack_at(local.number, local.before, local.buffers, update, batch, protocol)

    def _round_update(self, local: LocalRound) -> tuple[FedAvg, tuple[Tensor, Tensor], list[Tensor], str] | str:
        """The round as FedAvg describes it: the protocol, the images in order, and the update; or why not."""
        steps = local.steps
        if not steps:
            return "no optimizer step on the model's parameters"
        if any(s.batch is None for s in steps):
            return "the model trained on batches the monitor did not see; build the client with monitor.watch(loader)"
        if len({id(s.batch) for s in steps}) < len(steps):
            return "the optimizer stepped twice on one batch; FedAvg's attacker models one step per batch"
        lrs = {lr for s in steps for lr in s.lrs}
        if len(lrs) > 1:
            return f"the learning rate varied within the round ({', '.join(map(str, sorted(lrs)))}); FedAvg has one"
        passes = [[_inputs_labels(s.batch) for s in steps if s.pass_index == i]
                  for i in dict.fromkeys(s.pass_index for s in steps)]
        sizes = [[len(y) for _, y in p] for p in passes]
        if any(p != sizes[0] for p in sizes):
            return f"the passes over the loader trained on different batches ({sizes}); FedAvg repeats one pass"
        size = sizes[0][0]
        if any(n != size for n in sizes[0][:-1]) or sizes[0][-1] > size:
            return f"batch sizes {sizes[0]}: FedAvg's minibatches are all the same size but the last"
        inputs = torch.cat([torch.as_tensor(x) for x, _ in passes[0]])
        labels = torch.cat([torch.as_tensor(y).reshape(-1) for _, y in passes[0]])
        if len(labels) > self.max_images:
            return f"it trained on {len(labels)} images, more than max_images={self.max_images}"
        after = _sent_weights(self._model, local.sent)
        if isinstance(after, str):
            return after
        update = [b - a for b, a in zip(local.before, after)]
        protocol = FedAvg(local_epochs=len(passes), local_batch_size=size, local_lr=lrs.pop())
        return protocol, (inputs, labels), update, steps[0].optimizer

    # --- the report --------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Write report.html (and summary.json) from the rows so far; returns the summary."""
        from leakaudit.evaluator.run.runner import report_folder

        if not self.audited_steps:
            raise RunError(f"LeakMonitor: no step attacked yet in {self.out}; attach the monitor and train past "
                           f"step 0 (it attacks steps 0, {self.every}, {2 * self.every}, ...)")
        return report_folder(self.out, plugins_dirs=self.plugins_dirs)

    def _write_baselines(self) -> None:
        """Scores of guesses made without the update (noise, grey, the data's mean image) on every attacked
        batch so far: the verdict's bar."""
        folder, audit = self._folder, self._folder.audit
        records = (folder.load_reconstruction(AttackJob(audit.settings[0], audit.attacks[0], step, 0))
                   for step in self.audited_steps)
        batches = [(r["original"], r["labels"]) for r in records if r is not None]
        folder.write_json(BASELINES, guess_scores([m for m in self._prepared.scorers if m.on == "images"], batches,
                                                  self._mean_image(),
                                                  generator(torch.device("cpu"), self.seed, "baseline")))

    def _mean_image(self) -> Tensor | None:
        """The mean pixel image of up to 256 seeded items of the training set, computed once and kept."""
        path = self.out / CAPTURED / "mean_image.pt"
        if path.exists():
            return torch.load(path, weights_only=True)
        if self._dataset is None or not hasattr(self._dataset, "__len__"):
            return None
        gen = generator(torch.device("cpu"), self.seed, "mean_image")
        picks = torch.randperm(len(self._dataset), generator=gen)[:MEAN_IMAGE_SAMPLE].tolist()
        x = torch.stack([torch.as_tensor(_inputs_labels(self._dataset[i], single=True)[0]).float().cpu()
                         for i in picks])
        mean, std = (channel_stats(s, x.shape[1], x.device) for s in self._stats)
        image = (x * std + mean).clamp(0, 1).mean(dim=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(image, path)
        return image

    # --- what attach checks and records -------------------------------------------------------------------

    def _dp_settings(self, optimizer: Any, loader: Any) -> dict[str, Any] | None:
        """Opacus's noise multiplier, clipping norm, expected batch size and sampling rate, or None without it."""
        from opacus.optimizers import DPOptimizer

        if not isinstance(optimizer, DPOptimizer):
            return None
        dataset = getattr(loader, "dataset", None)
        rate = getattr(loader, "sample_rate", None)
        if rate is None and dataset is not None and hasattr(dataset, "__len__"):
            rate = optimizer.expected_batch_size / len(dataset)
        return {"noise_multiplier": float(optimizer.noise_multiplier), "max_grad_norm": float(optimizer.max_grad_norm),
                "expected_batch_size": int(optimizer.expected_batch_size), "sample_rate": rate}

    def _defense_entry(self, problems: list[str]) -> str | dict[str, Any]:
        """The defense as an audit entry: the user's, or ``dpsgd`` with Opacus's settings under a DPOptimizer."""
        if self._dp is None:
            return self.defense
        registry = load_registry(self.plugins_dirs)
        kinds = {n: registry.get("defense", n) for n in registry.names("defense")}
        mirror = next(n for n, cls in kinds.items() if cls.mirrors_dp_optimizer)
        named = self.defense.get("name") if isinstance(self.defense, dict) else self.defense
        if named not in kinds or not (kinds[named].baseline or kinds[named].mirrors_dp_optimizer):
            problems.append(f"defense: {named!r}: the optimizer is Opacus's DPOptimizer, whose update is already "
                            f"DP-SGD's; leave defense out (or name {mirror})")
        return {"name": mirror, "params": {k: self._dp[k] for k in ("noise_multiplier", "max_grad_norm")}}

    def _epsilon(self) -> float | None:
        """Epsilon at ``delta`` spent so far (this step included) under Opacus, from its RDP accountant."""
        if self._dp is None or self._dp["sample_rate"] is None:
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
        """One training input's shape (C, H, W), read from the dataset's first item; None when it has none."""
        if dataset is None or not hasattr(dataset, "__getitem__") or not len(dataset):
            return None
        x = torch.as_tensor(_inputs_labels(dataset[0], single=True)[0])
        if x.dim() != 3:
            problems.append(f"loader: its items hold inputs of shape {tuple(x.shape)}; the attacks rebuild images "
                            "(C, H, W)")
            return None
        return tuple(x.shape)

    def _unoptimised(self, model: nn.Module) -> list[str]:
        """Trainable parameters the optimizer does not step (their update cannot be read off the weights)."""
        stepped = {id(p) for g in self._inner.param_groups for p in g["params"]}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in stepped]
        zero = [i for i, g in enumerate(self._inner.param_groups) if not g.get("lr")]
        return ([f"optimizer: does not step {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; give it "
                 "every trainable parameter of the model"] if missing else []) + (
            [f"optimizer: param_groups {zero} have lr 0; the update is read as (before - after) / lr"] if zero else [])

    @staticmethod
    def _batch_size(optimizer: Any, loader: Any) -> int:
        return int(getattr(optimizer, "expected_batch_size", None) or getattr(loader, "batch_size", None) or 1)

    def _describe(self, plain: nn.Module, defense: Any, protocol: Any, batch_size: int,
                  shape: tuple | None, federated: bool) -> dict[str, Any]:
        """``monitor.json``: what ``monitor_audit`` rebuilds this monitor's audit from. Federated rounds add the
        rounds taken part in (``fits``) and each audited round's local training (``rounds``, ``protocol``)."""
        rounds = {"fits": 0, "rounds": {}, "skipped": {}, "protocol": protocol.name} if federated else {}
        return rounds | {"name": self.name, "seed": self.seed, "data": "the training loop's batches (LeakMonitor)",
                "model": type(plain).__name__, "mode": "train" if plain.training else "eval",
                "image_size": min(shape[-2:]) if shape else 32, "batch_size": batch_size,
                "defense": defense, "attacks": self.attacks, "metrics": self.metrics,
                "known_labels": self.known_labels, "delta": self.delta, "every": self.every, "attacker": self.attacker,
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

        device = next(self._model.parameters()).device.type
        folder.start_session({"versions": versions(), "device": f"{device}: inside the training process (LeakMonitor)",
                              "device_type": device, "deterministic": True, "audit_file": str(saved),
                              "chance_accuracy": None})
        return folder


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
    x, y = torch.as_tensor(a, dtype=torch.float64).flatten(), torch.as_tensor(b, dtype=torch.float64).flatten()
    return x.shape == y.shape and bool(torch.allclose(x, y, atol=1e-6))


def _inputs_labels(batch: Any, single: bool = False) -> tuple[Any, Any]:
    """The inputs and labels of a ``(inputs, labels, ...)`` batch or dataset item."""
    if isinstance(batch, dict):
        inputs = next((batch[k] for k in ("inputs", "image", "img") if k in batch), None)
        return inputs, next((batch[k] for k in ("labels", "label") if k in batch), None)
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ConfigError([f"LeakMonitor: loader: a {'dataset item' if single else 'batch'} is a "
                           f"{type(batch).__name__}; expected (inputs, labels)"])
    return batch[0], batch[1]


def _optimizer_text(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class and the settings FedAvg's plain-SGD attacker does not model, e.g. SGD(momentum=0.9)."""
    group = optimizer.param_groups[0]
    odd = {k: group[k] for k in ("momentum", "weight_decay") if group.get(k)}
    return f"{type(optimizer).__name__}({', '.join(f'{k}={v}' for k, v in odd.items())})"


def _sent_weights(model: nn.Module, sent: Sequence[Any] | None) -> list[Tensor] | str:
    """The trainable parameters' values the client sends: from ``sent`` (arrays in the order of the model's
    ``state_dict`` or of its trainable parameters), or the model's own when None; or why they cannot be read."""
    params = trainable(model)
    if sent is None:
        return [p.detach().clone() for p in params]
    state = model.state_dict()
    shapes = [tuple(getattr(a, "shape", ())) for a in sent]
    if shapes == [tuple(v.shape) for v in state.values()]:
        by_name = dict(zip(state, sent))
        sent = [by_name[n] for n in parameter_names(model)]
    elif shapes != [tuple(p.shape) for p in params]:
        return (f"the client sends {len(shapes)} arrays, matching neither the model's state_dict ({len(state)}) "
                f"nor its trainable parameters ({len(params)}) in order and shape")
    return [torch.as_tensor(a).to(device=p.device, dtype=p.dtype) for a, p in zip(sent, params)]


def _state(model: nn.Module) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Copies of the model's trainable parameters and buffers, for ``_load`` to put back."""
    return [p.detach().clone() for p in trainable(model)], {n: b.detach().clone() for n, b in model.named_buffers()}


@torch.no_grad()
def _load(model: nn.Module, params: list[Tensor], buffers: dict[str, Tensor]) -> None:
    for p, value in zip(trainable(model), params):
        p.copy_(value)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
