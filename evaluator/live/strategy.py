"""LeakAuditStrategy: a Flower federation audited from where its attacker sits, the server (install
``leakaudit[flower]``).

It wraps any Flower server ``Strategy`` and leaves what it does unchanged: the wrapped strategy configures
the rounds and aggregates the updates, and the aggregate is the wrapped strategy's. Beside it, every
``every``-th round, each client's update (the global weights sent minus the weights returned) is attacked as
the FedAvg update it is: the client's local epochs and learning rate are read from the fit config the
strategy sent, its minibatch size from its loader. The mean of the clients' updates, what a server under
secure aggregation sees, is attacked too, as FedAvg over all of the clients' images. Each client's rows go to
``out/client-NAME``, the mean's to ``out/aggregate``: run folders that ``leakaudit report`` reads like any.

A server holds no images, so the attacks cannot be scored there: auditing a federation in simulation, the
team gives the strategy each client's loader (``client_loader``), the same loader the client trains on, in
the same order (no shuffling, or a fixed order).
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import ConcatDataset, DataLoader

from leakaudit.defenses.flower import accountant_reading, flower_accountant, integer_arrays_refusal
from leakaudit.evaluator.audit.seeds import generator
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.live.core import (
    MAX_ROUND_IMAGES,
    inputs_labels,
    joined,
    load_model_state,
    model_state,
    monitor_logger,
)
from leakaudit.evaluator.live.flower import mirrored_defense
from leakaudit.evaluator.live.monitor import LeakMonitor
from leakaudit.evaluator.live.rounds import sample_round, sent_weights
from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.protocol import FedAvg

try:
    from flwr.common import parameters_to_ndarrays
    from flwr.server.strategy import Strategy
    from flwr.serverapp.strategy import Strategy as MessageStrategy
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("leakaudit's Flower strategy needs Flower: pip install 'leakaudit[flower]'") from exc

AGGREGATE = "aggregate"


@dataclass
class ClientRound:
    """One client's round as FedAvg describes it: its images in training order, its update, its loader."""

    name: str
    examples: int
    batch: tuple[Tensor, Tensor]
    update: list[Tensor]
    loader: Any
    protocol: FedAvg
    sampled: str | None = None  # how the round was cut to a sample the attacks can take


class LeakAuditStrategy(Strategy, MessageStrategy):
    """``strategy``, with the updates it aggregates attacked every ``every``-th round (rounds 1, 1 + every, ...).

    ``strategy`` is a current Flower strategy (``flwr.serverapp.strategy``, run by ``strategy.start`` in a
    ``ServerApp``'s main) or an older one (``flwr.server.strategy``, run by ``ServerAppComponents``): each of
    its methods is called as that API calls it, and only the training rounds' replies are read.
    ``model`` is the network the federation trains (its weights are replaced by each round's global ones);
    ``client_loader(name)`` gives the loader a client trains on, where ``name`` is the value of ``client_key``
    in the metrics its training returns (its partition id, say) or else Flower's node id. ``lr_key`` and
    ``epochs_key`` name the config entries the clients train with; an absent ``epochs_key`` is ``local_epochs``
    (one, unless given). ``aggregate``: also attack the mean of the round's updates. A client that trains on
    more than ``max_images`` images is attacked on a seeded sample of its minibatches, through the update the
    sample makes from the round's weights (said in its monitor.json and on the log). The remaining keywords
    configure each client's ``LeakMonitor`` (defense, attacks, metrics, mean, std, known_labels, seed, ...).

    A Flower central-DP strategy (``DifferentialPrivacy{ClientSide,ServerSide}{Fixed,Adaptive}Clipping``) is read
    where it is wrapped: it noises the mean after this server holds each update, so each client's update is
    attacked as the global model's observers see it (``flower_fixed_clipping`` or ``flower_adaptive_clipping`` with
    the strategy's settings), beside the update as the server itself holds it (the undefended reference); the mean
    of the round is attacked as the server holds it, before its noise.
    """

    def __init__(self, strategy: Strategy | MessageStrategy, model: nn.Module, client_loader: Callable[[str], Any],
                 *, out: str | Path = "runs/flower_server", every: int = 1, lr_key: str = "lr",
                 epochs_key: str = "local_epochs", local_epochs: int = 1, client_key: str = "partition",
                 aggregate: bool = True, max_images: int = MAX_ROUND_IMAGES, **monitor: Any) -> None:
        problems = [] if isinstance(every, int) and every >= 1 else [f"every: {every!r}; expected a whole number >= 1"]
        problems += [] if callable(client_loader) else ["client_loader: expected a function of a client's name"]
        problems += [] if isinstance(strategy, (Strategy, MessageStrategy)) else [
            f"strategy: a {type(strategy).__name__}; expected a Flower Strategy (flwr.serverapp.strategy or "
            "flwr.server.strategy)"]
        problems += [] if isinstance(local_epochs, int) and local_epochs >= 1 else [
            f"local_epochs: {local_epochs!r}; expected a whole number >= 1"]
        self._mirrored, _ = mirrored_defense([strategy], monitor.get("plugins_dirs", ()))  # a Flower DP strategy
        problems += [] if self._mirrored is None or "defense" not in monitor else [
            f"defense: given beside {type(strategy).__name__}, whose mechanism is the defense audited; leave it out"]
        if self._mirrored is not None and (why := integer_arrays_refusal("strategy", model.state_dict())):
            problems.append(why)
        if problems:
            raise ConfigError([f"LeakAuditStrategy: {p}" for p in problems])
        LeakMonitor(**monitor, out=Path(out) / AGGREGATE)  # the monitor's settings, checked before any round
        self._accountant = flower_accountant(strategy) if self._mirrored is not None else None
        if self._mirrored is not None:
            LeakMonitor(**monitor, defense=self._mirrored, out=Path(out) / AGGREGATE)
            monitor_logger().info("LeakAuditStrategy: %s noises the mean after this server holds each update: each "
                                  "client's update is attacked as the global model's observers see it (%s %s), "
                                  "beside the update as the server holds it", type(strategy).__name__,
                                  self._mirrored["name"], self._mirrored["params"])
        self.strategy, self.model, self.client_loader = strategy, copy.deepcopy(model), client_loader
        self.out, self.every, self.aggregate, self.max_images = Path(out), every, aggregate, max_images
        self.lr_key, self.epochs_key, self.client_key = lr_key, epochs_key, client_key
        self.local_epochs = local_epochs
        self._settings = monitor
        self._monitors: dict[str, LeakMonitor] = {}
        self._sent: dict[int, list[Any]] = {}
        self._configs: dict[int, dict[str, dict[str, Any]]] = {}
        self._fits: dict[str, int] = {}  # the rounds each client (by name) took part in
        self._population: list[int] = []  # under an accountant: the nodes each round sampled from, and how many
        self._sampled: list[int] = []
        self._flagged: set[str] = set()  # the mismatches logged already

    def __repr__(self) -> str:
        return f"LeakAuditStrategy({self.strategy!r})"

    def initialize_parameters(self, client_manager):
        return self.strategy.initialize_parameters(client_manager)

    def configure_fit(self, server_round, parameters, client_manager):
        """The wrapped strategy's fit instructions; the weights and each client's config are kept to audit."""
        instructions = self.strategy.configure_fit(server_round, parameters, client_manager)
        if self._audited(server_round):
            self._sent[server_round] = parameters_to_ndarrays(parameters)
            self._configs[server_round] = {proxy.cid: dict(ins.config) for proxy, ins in instructions}
        return instructions

    def aggregate_fit(self, server_round, results, failures):
        """The wrapped strategy's aggregate, unchanged; then, in an audited round, each update attacked. The
        client's name (``client_key`` in its metrics) is read here and kept out of the metrics aggregated."""
        self._took_part(str(res.metrics.get(self.client_key, proxy.cid)) for proxy, res in results)
        trained = [(proxy.cid, dict(res.metrics), res.num_examples, parameters_to_ndarrays(res.parameters))
                   for proxy, res in results] if server_round in self._sent else []
        results = [(proxy, dataclasses.replace(res, metrics={k: v for k, v in res.metrics.items()
                                                             if k != self.client_key})) for proxy, res in results]
        aggregated = self.strategy.aggregate_fit(server_round, results, failures)
        if server_round in self._sent:
            self._audit(server_round, trained)
        return aggregated

    def configure_train(self, server_round, arrays, config, grid):
        """The wrapped strategy's training messages (Flower's Message API); the global arrays and each node's
        config are kept to audit."""
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if self._accountant is not None:
            self._population.append(len(list(grid.get_node_ids())))
            self._sampled.append(len(messages))
        if self._audited(server_round):
            self._sent[server_round] = arrays.to_numpy_ndarrays()
            self._configs[server_round] = {m.metadata.dst_node_id: dict(m.content.config_records.get(
                "config", next(iter(m.content.config_records.values()), {}))) for m in messages}
        return messages

    def aggregate_train(self, server_round, replies):
        """The wrapped strategy's aggregate of the replies, unchanged; then, in an audited round, each update
        attacked."""
        replies = list(replies)
        self._took_part(str(dict(next(iter(r.content.metric_records.values()), {})).get(
            self.client_key, r.metadata.src_node_id)) for r in replies if not r.has_error())
        trained = [(reply.metadata.src_node_id, *_trained(reply)) for reply in replies
                   if not reply.has_error()] if server_round in self._sent else []
        for reply in replies:  # the client's name is leakaudit's: kept out of the metrics Flower aggregates
            for record in ([] if reply.has_error() else reply.content.metric_records.values()):
                record.pop(self.client_key, None)
        aggregated = self.strategy.aggregate_train(server_round, replies)
        if server_round in self._sent:
            self._audit(server_round, trained)
        if self._accountant is not None:
            self._read_accountant()
        return aggregated

    def _read_accountant(self) -> None:
        """The DP strategy's accountant's claimed epsilon beside leakaudit's own and each mismatch: logged, and
        kept in each client's run folder for its report's privacy table."""
        assert self._mirrored is not None, "an accountant is read from the mirrored DP strategy"
        params = self._mirrored["params"]
        defense = load_registry(self._settings.get("plugins_dirs", ())).get("defense", self._mirrored["name"])(
            **params)
        lines = accountant_reading(self._accountant, defense, params["num_sampled_clients"], self._population,
                                   self._sampled)
        log = monitor_logger()
        for line in lines:
            if line.startswith("MISMATCH") and line not in self._flagged:
                log.warning("LeakAuditStrategy: %s", line)
                self._flagged.add(line)
            elif not line.startswith("MISMATCH"):
                log.info("LeakAuditStrategy: %s", line)
        for name, monitor in self._monitors.items():
            if name != AGGREGATE:
                monitor.claimed(lines)

    def configure_evaluate(self, server_round, *args, **kwargs):
        """The wrapped strategy's, as Flower calls it (by position or, as its server does, by keyword)."""
        return self.strategy.configure_evaluate(server_round, *args, **kwargs)

    def aggregate_evaluate(self, server_round, *args, **kwargs):
        return self.strategy.aggregate_evaluate(server_round, *args, **kwargs)

    def evaluate(self, server_round, parameters):
        return self.strategy.evaluate(server_round, parameters)

    def summary(self) -> None:
        if isinstance(self.strategy, MessageStrategy):  # an older strategy has none to print
            self.strategy.summary()

    def report(self) -> dict[str, Any]:
        """Each run folder's report.html and summary.json: the typed summaries by folder name."""
        for name, monitor in self._monitors.items():
            if name in self._fits:
                monitor.took_part(self._fits[name])
        return {name: monitor.report() for name, monitor in self._monitors.items() if monitor.audited_steps}

    def _took_part(self, names: Iterable[str]) -> None:
        """Count a round's replies by client: each client's guarantee is composed over the rounds it took part
        in, audited or not."""
        for name in names:
            self._fits[name] = self._fits.get(name, 0) + 1

    def _audited(self, server_round: int) -> bool:
        return (server_round - 1) % self.every == 0

    def _audit(self, server_round: int, results: list[tuple[Any, dict, int, list]]) -> None:
        """Attack each client's update and the mean of those that can be attacked together; ``results``: each
        client's (id, metrics, examples, returned arrays)."""
        sent, configs = self._sent.pop(server_round), self._configs.pop(server_round)
        before, buffers = self._global_state(sent)
        rounds = []
        named = sorted(((str(metrics.get(self.client_key, cid)), cid, examples, arrays)
                        for cid, metrics, examples, arrays in results), key=lambda item: item[0])
        for name, cid, examples, arrays in named:
            found = self._client_round(server_round, name, examples, configs.get(cid, {}), before, buffers, arrays)
            if isinstance(found, str):
                warnings.warn(f"LeakAuditStrategy: round {server_round}, client {name} not attacked: {found}",
                              stacklevel=3)
                continue
            rounds.append(found)
        if not rounds:
            return
        population = _population(rounds)
        for r in rounds:
            monitor = self._monitor(r.name, population)
            monitor.took_part(self._fits.get(r.name, 0))
            if r.sampled:
                monitor.sampled(server_round, r.sampled)
            monitor.audit_safely(server_round, lambda: monitor.attack_round(server_round, before, buffers, r.update,
                                                                            r.batch, r.protocol))
        if self.aggregate and len(rounds) > 1:
            self._attack_mean(server_round, before, buffers, rounds, population)

    def _global_state(self, sent: list[Any]) -> tuple[list[Tensor], dict[str, Tensor]]:
        """The trainable weights and buffers of the model at the global weights sent this round."""
        state = self.model.state_dict()
        if [tuple(a.shape) for a in sent] == [tuple(v.shape) for v in state.values()]:
            self.model.load_state_dict({k: torch.as_tensor(a) for k, a in zip(state, sent)})
            return model_state(self.model)
        weights = sent_weights(self.model, sent)
        if isinstance(weights, str):
            raise ConfigError([f"LeakAuditStrategy: the global weights: {weights}"])
        load_model_state(self.model, weights, dict(self.model.named_buffers()))
        return model_state(self.model)

    def _client_round(self, server_round: int, name: str, examples: int, config: dict[str, Any],
                      before: list[Tensor], buffers: dict[str, Tensor], returned: list[Any]) -> ClientRound | str:
        """One client's round as FedAvg describes it (on a seeded sample of its minibatches past
        ``max_images``), or why it cannot."""
        if self.lr_key not in config:
            return f"its config has no {self.lr_key!r} (the learning rate FedAvg's attacker unrolls)"
        loader = self.client_loader(name)
        batches = [inputs_labels(b) for b in loader]
        if not batches:
            return "its loader gives no batch"
        after = sent_weights(self.model, returned)
        if isinstance(after, str):
            return after
        protocol = FedAvg(local_epochs=int(config.get(self.epochs_key, self.local_epochs)),
                          local_batch_size=len(batches[0][1]), local_lr=float(config[self.lr_key]))
        batch = joined(batches)
        if len(batch[1]) <= self.max_images:
            return ClientRound(name, examples, batch, [b - a for b, a in zip(before, after)], loader, protocol)
        batch, protocol, update, how = sample_round(
            self.model, self._settings.get("loss_fn", F.cross_entropy), before, buffers, batches, protocol,
            self.max_images, generator(torch.device("cpu"), self._settings.get("seed", 0), "round-sample",
                                       server_round, name))
        return ClientRound(name, examples, batch, update, loader, protocol, how)

    def _monitor(self, name: str, loader: Any) -> LeakMonitor:
        """The monitor writing ``out/client-NAME`` (or ``out/aggregate``), bound to the model on first use with
        ``loader`` (the federation's images: its normalisation, and the mean image a guess without the update
        makes)."""
        if name not in self._monitors:
            folder = self.out / (name if name == AGGREGATE else f"client-{name}")
            own: dict[str, Any] = {} if self._mirrored is None or name == AGGREGATE else {"defense": self._mirrored}
            monitor = LeakMonitor(**self._settings, **own, every=self.every, out=folder)
            monitor.bind_rounds(self.model, loader, self.max_images)
            self._monitors[name] = monitor
        return self._monitors[name]

    def _attack_mean(self, server_round: int, before: list[Tensor], buffers: dict[str, Tensor],
                     rounds: list[ClientRound], population: Any) -> None:
        """The mean of the clients' updates, attacked as FedAvg over all of their images (secure aggregation's
        view), where the clients trained alike on equally many images."""
        protocols = {r.protocol for r in rounds}
        counts = {len(r.batch[1]) for r in rounds}
        if len(protocols) > 1 or len(counts) > 1 or len({r.examples for r in rounds}) > 1:
            warnings.warn(f"LeakAuditStrategy: round {server_round}'s mean not attacked: its clients trained on "
                          "different numbers of images or with different settings", stacklevel=4)
            return
        mean = [torch.stack(parts).mean(0) for parts in zip(*(r.update for r in rounds))]
        batch = (torch.cat([r.batch[0] for r in rounds]), torch.cat([r.batch[1] for r in rounds]))
        joint = dataclasses.replace(protocols.pop(), clients=len(rounds))
        monitor = self._monitor(AGGREGATE, population)
        monitor.audit_safely(server_round, lambda: monitor.attack_round(server_round, before, buffers, mean, batch,
                                                                        joint))


def _trained(reply: Any) -> tuple[dict[str, Any], int, list[Any]]:
    """A Message-API training reply's metrics, number of examples and returned arrays."""
    content = reply.content
    metrics = dict(next(iter(content.metric_records.values()), {}))
    arrays = next(iter(content.array_records.values())).to_numpy_ndarrays()
    return metrics, int(metrics.get("num-examples", 0)), arrays


def _population(rounds: list[ClientRound]) -> Any:
    """The clients' images of a round together, as one loader: the data an attacker's guess without the update
    draws its mean image from (less the attacked batch's own images, ``core.mean_without``)."""
    loaders = [r.loader for r in rounds]
    found = [getattr(loader, "dataset", None) for loader in loaders]
    datasets = [d for d in found if d is not None]
    if len(datasets) < len(found):
        return loaders[0]
    return DataLoader(ConcatDataset(datasets), batch_size=getattr(loaders[0], "batch_size", None) or 1)
