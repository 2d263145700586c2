"""Monitoring a federated client round by round: the optimizers made inside each round are watched, and the
round's update is attacked as FedAvg's."""
from __future__ import annotations

import dataclasses
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from leakaudit.evaluator.audit.seeds import generator
from leakaudit.evaluator.live.core import (
    MAX_ROUND_IMAGES,
    MonitorCore,
    MonitoredLoader,
    inputs_labels,
    joined,
    load_model_state,
    loaders_observed,
    model_state,
    own_random_state,
)
from leakaudit.evaluator.results.rundir import MONITOR, RunError
from leakaudit.plugins.protocol import FedAvg, parameter_names, trainable


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
    params: set[int] | None  # the model's parameters (None: any optimizer's steps, the model not known yet)
    sent: Sequence[Any] | None = None
    before: list[Tensor] | None = None
    buffers: dict[str, Tensor] | None = None
    steps: list[_RoundStep] = field(default_factory=list)
    loader: Any = None  # the loader of the first step's batch
    device: torch.device | None = None  # where the first step's parameters live


def _optimizer_text(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class and the settings FedAvg's plain-SGD attacker does not model, e.g. SGD(momentum=0.9)."""
    group = optimizer.param_groups[0]
    odd = {k: group[k] for k in ("momentum", "weight_decay") if group.get(k)}
    return f"{type(optimizer).__name__}({', '.join(f'{k}={v}' for k, v in odd.items())})"


def sent_weights(model: nn.Module, sent: Sequence[Any] | None) -> list[Tensor] | str:
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


def sample_round(model: nn.Module, loss_fn: Any, before: list[Tensor], buffers: dict[str, Tensor],
                 batches: Sequence[tuple[Any, Any]], protocol: FedAvg, max_images: int,
                 gen: torch.Generator) -> tuple[tuple[Tensor, Tensor], FedAvg, list[Tensor], str]:
    """A round over more than ``max_images`` images, cut to a seeded sample the attacks can take: whole
    minibatches (in training order) up to ``max_images`` images, or ``max_images`` images of one minibatch
    when a minibatch alone is larger. Returns the sample, its FedAvg protocol, the update it makes from
    ``before`` (``round_update``) and a line saying what was done."""
    size = len(torch.as_tensor(batches[0][1]).reshape(-1))
    total = sum(len(torch.as_tensor(y).reshape(-1)) for _, y in batches)
    if size <= max_images:
        full = [i for i, (_, y) in enumerate(batches) if len(torch.as_tensor(y).reshape(-1)) == size]
        keep = sorted(full[i] for i in torch.randperm(len(full), generator=gen)[:max_images // size].tolist())
        batch = joined([batches[i] for i in keep])
        what = f"{len(keep)} of its {len(batches)} minibatches"
    else:
        x, y = joined([batches[int(torch.randint(len(batches), (1,), generator=gen))]])
        pick = torch.randperm(len(y), generator=gen)[:max_images].sort().values
        batch, size = (x[pick], y[pick]), max_images
        what = f"{max_images} images of one minibatch"
    sample = dataclasses.replace(protocol, local_batch_size=size)
    how = (f"it trained on {total} images, more than max_images={max_images}: attacked on a seeded sample, {what} "
           f"({len(batch[1])} images), through the update they make from the round's weights in "
           f"{protocol.local_epochs} local epoch(s) at lr {protocol.local_lr:g}")
    return batch, sample, round_update(model, loss_fn, before, buffers, batch, sample), how


def round_update(model: nn.Module, loss_fn: Any, before: list[Tensor], buffers: dict[str, Tensor],
                 batch: tuple[Tensor, Tensor], protocol: FedAvg) -> list[Tensor]:
    """``theta_before - theta_after`` of ``protocol``'s local training on ``batch`` from ``before``, computed
    on ``model`` (whose own weights and random state are put back)."""
    params = trainable(model)
    device = params[0].device
    after, now = model_state(model)
    try:
        with own_random_state(device):
            load_model_state(model, before, buffers)
            return protocol.client_update(model, loss_fn, batch[0].to(device), batch[1].to(device))
    finally:
        load_model_state(model, after, now)


class RoundMonitor(MonitorCore):
    """A monitor bound to a federated client (``bind_rounds``, ``local_round``): every ``every``-th round's
    local training is attacked as FedAvg's update, over the batches the watched loader gave."""

    def watch(self, loader: Any) -> MonitoredLoader:
        """``loader``, telling this monitor each batch and each pass: build a federated client with it, for
        ``bind_rounds`` and ``local_round`` (Flower's ``LeakAuditClient``)."""
        self.watched = loader
        return MonitoredLoader(loader, self)

    def bind_rounds(self, model: nn.Module, loader: Any, max_images: int = MAX_ROUND_IMAGES) -> None:
        """``attach`` for federated clients, whose optimizer is made anew in each round: check the audit and
        open the run folder; ``local_round`` then audits each round's update. Raises ConfigError before any
        work. ``max_images``: a round that trains on more images is attacked on a seeded sample of its
        minibatches, through the update the sample makes from the round's weights (said on the log)."""
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
        self.folder.write_json(MONITOR, self._described)

    @contextmanager
    def local_round(self, server_round: int | None = None) -> Iterator[LocalRound]:
        """Audit the local training inside the block as one federated round (after ``bind_rounds``).

        Rounds 1, 1 + every, ... are attacked, numbered by ``server_round``, else by this client's count of
        its rounds. The steps of any optimizer over the model's parameters are watched; the round's update,
        ``theta_before - theta_after``, is attacked as FedAvg's over the watched loader's batches in the order
        drawn. ``theta_after`` is ``LocalRound.sent`` when the block sets it (what leaves the client), else
        the model's weights. A round that FedAvg cannot describe is not attacked, and a warning says why."""
        if self._folder is None or not self._federated:
            raise RunError("LeakMonitor.local_round: call bind_rounds(model, loader) first")
        self._described["fits"] += 1
        number = self._described["fits"] if server_round is None else int(server_round)
        local = LocalRound(number, {id(p) for p in self.model.parameters()})
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
            self.audit_safely(number, lambda: self._audit_round(local))
        self.folder.write_json(MONITOR, self._described)

    @contextmanager
    def observe_round(self, number: int) -> Iterator[LocalRound]:
        """Watch round ``number`` before the model is known (a Flower mod): every optimizer step in the block
        and the batches every DataLoader iterated in this thread yields; ``finish_round`` then audits it."""
        local = LocalRound(number, None)
        self._batch, self._round = None, local
        handle = register_optimizer_step_pre_hook(self._round_step)
        try:
            with loaders_observed(self):
                yield local
        finally:
            handle.remove()
            self._round = None

    def took_part(self, fits: int) -> None:
        """Record that the client has taken part in ``fits`` rounds so far (audited or not, counted by a caller
        that sees every round: a Flower mod, the server): each released its update, and the report composes a
        per-round guarantee over them. A count below the one recorded is ignored."""
        self._described["fits"] = max(int(self._described.get("fits", 0)), int(fits))
        self.folder.write_json(MONITOR, self._described)

    def finish_round(self, local: LocalRound, model: nn.Module, sent: Sequence[Any], fits: int | None = None) -> None:
        """Audit a round watched by ``observe_round``: ``model`` is the network at the round's starting weights
        (moved where training ran), ``sent`` the arrays the client returns, ``fits`` the rounds the client has
        taken part in, this one included, where the caller counts them. Binds the monitor to them first
        (ConfigError, one line per problem); a round already in the run folder is not attacked again."""
        if local.device is not None:
            model.to(local.device)
        if local.loader is None:
            why = "no DataLoader batch reached an optimizer step in this thread; leakaudit audits the batches a " \
                  "torch DataLoader gives"
            self.bind_rounds(model, None, self.max_images)
            self.skip(local.number, why)
            return
        self.bind_rounds(model, local.loader, self.max_images)
        if local.number in self._described["steps"]:
            return
        self._described["fits"] = max(self._described["fits"] + 1, fits or 0)
        local.before, local.buffers = model_state(model)
        local.sent = sent
        self.audit_safely(local.number, lambda: self._audit_round(local))
        self.folder.write_json(MONITOR, self._described)

    def _round_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before each optimizer step in an audited round: the first keeps the weights; each keeps its batch."""
        local = self._round
        groups = optimizer.param_groups
        if local is None or (local.params is not None
                             and not any(id(p) in local.params for g in groups for p in g["params"])):
            return
        if local.before is None and local.params is not None:
            local.before, local.buffers = model_state(self.model)
        if not local.steps:
            local.loader, local.device = self._source, groups[0]["params"][0].device
        local.steps.append(_RoundStep(self._batch, self._passes, tuple(float(g["lr"]) for g in groups),
                                      _optimizer_text(optimizer)))

    def _audit_round(self, local: LocalRound) -> None:
        found = self._round_update(local)
        if isinstance(found, str):
            self.skip(local.number, found)
            warnings.warn(f"LeakMonitor: round {local.number} not attacked: {found}", stacklevel=3)
            return
        protocol, batch, update, optimizer = found
        assert local.before is not None and local.buffers is not None, "kept at the round's first step"
        self.attack_round(local.number, local.before, local.buffers, update, batch, protocol, optimizer)

    def attack_round(self, number: int, before: list[Tensor], buffers: dict[str, Tensor], update: list[Tensor],
                     batch: tuple[Tensor, Tensor], protocol: FedAvg, optimizer: str = "SGD()") -> None:
        """Attack round ``number``'s update (``theta_before - theta_after`` of the trainable parameters) as
        ``protocol``'s over ``batch``'s images in training order, the model at ``before`` and ``buffers``: the
        client's own view (``local_round``) or the server's (``LeakAuditStrategy``)."""
        self._described["rounds"][str(number)] = {**dataclasses.asdict(protocol), "images": len(batch[1]),
                                                  "optimizer": optimizer}  # the report's: the last round's
        self._attack_at(number, before, buffers, update, batch, protocol)

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
        passes = [[inputs_labels(s.batch) for s in steps if s.pass_index == i]
                  for i in dict.fromkeys(s.pass_index for s in steps)]
        sizes = [[len(y) for _, y in p] for p in passes]
        if any(p != sizes[0] for p in sizes):
            return f"the passes over the loader trained on different batches ({sizes}); FedAvg repeats one pass"
        size = sizes[0][0]
        if any(n != size for n in sizes[0][:-1]) or sizes[0][-1] > size:
            return f"batch sizes {sizes[0]}: FedAvg's minibatches are all the same size but the last"
        protocol = FedAvg(local_epochs=len(passes), local_batch_size=size, local_lr=lrs.pop())
        if local.before is None or local.buffers is None:
            return "the weights before the round were not kept"
        if sum(len(y) for _, y in passes[0]) > self.max_images:
            batch, protocol, update, how = sample_round(
                self.model, self.loss_fn, local.before, local.buffers, passes[0], protocol, self.max_images,
                generator(torch.device("cpu"), self.seed, "round-sample", local.number))
            self.sampled(local.number, how)
            return protocol, batch, update, steps[0].optimizer
        after = sent_weights(self.model, local.sent)
        if isinstance(after, str):
            return after
        update = [b - a for b, a in zip(local.before, after)]
        return protocol, joined(passes[0]), update, steps[0].optimizer

    def aggregated(self, line: str) -> None:
        """Record who sees the client's update under secure aggregation (a Flower ``secaggplus_mod``): the report's
        threat box says it."""
        self._described["secure_aggregation"] = line
        self.folder.write_json(MONITOR, self._described)

    def claimed(self, lines: Sequence[str]) -> None:
        """Record what the framework's own privacy accountant claims beside leakaudit's accounting, and each
        mismatch, one line each (``LeakAuditStrategy`` over a Flower DP strategy's accountant): the report's
        privacy table shows them."""
        self._described["claimed"] = list(lines)
        self.folder.write_json(MONITOR, self._described)

    def sampled(self, number: int, how: str) -> None:
        """Record (and log) that round ``number`` is attacked on a sample of its images, and how."""
        self._described.setdefault("sampled", {})[str(number)] = how
        self.log.info("LeakMonitor round %d: %s", number, how)
