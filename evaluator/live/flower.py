"""LeakMonitor on a Flower client: each round's update attacked before it leaves (install ``leakaudit[flower]``).

``LeakAuditMod`` is a client mod for Flower's Message API (``ClientApp(mods=[...])``, ``@app.train()``): around
the app's train function it watches every optimizer step and the batches every DataLoader the function
iterates yields, then attacks the arrays the reply returns as the round's FedAvg update from the arrays the
message brought (``LeakMonitor.observe_round``). ``LeakAuditClient`` wraps an older app's ``NumPyClient`` the
same way around its ``fit``, over the batches of the loader the monitor watches (``LeakMonitor.local_round``).
Rounds are numbered by the round the server sends in the config (``server-round``, ``server_round``), else
by the client's own count of rounds it took part in, kept in its run folder. Flower mods that change the update
(``LocalDpMod``) run inside ``LeakAuditMod(mods=[...])`` on train messages: the round's clean update is taken before
them and audited under the defense that reads their mechanism (``Defense.mirrored_settings``), with its likelihood
and epsilon; Flower's secure aggregation mods (``secaggplus_mod``) are read as who sees the update; a mod no defense
reads is refused in one line.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from leakaudit.defenses.flower import integer_arrays_refusal
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.live.monitor import MAX_ROUND_IMAGES, LeakMonitor
from leakaudit.plugins.defense import Defense
from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.spec import one_line

try:
    from flwr.app import Message, MessageType
    from flwr.client import NumPyClient
    from flwr.client.mod.utils import make_ffn
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("leakaudit's Flower client needs Flower: pip install 'leakaudit[flower]'") from exc

ROUND_KEYS = ("server-round", "server_round")  # where strategies put the round's number in the config
SECAGG_STATE = "secaggplus_state"  # where secaggplus_mod keeps its state in the Context (sample_num: clients summed)


def secure_aggregation(mod: Any) -> str | None:
    """The secure aggregation protocol a Flower client mod runs (``secaggplus_mod``: "SecAgg+", ``secagg_mod``:
    "SecAgg", from ``flwr.client.mod``); None for any other. Flower is not imported here: a mod of its protocols
    means it is loaded already."""
    module = sys.modules.get("flwr.client.mod")
    for name, protocol in (("secaggplus_mod", "SecAgg+"), ("secagg_mod", "SecAgg")):
        if module is not None and mod is getattr(module, name, None):
            return protocol
    return None


def mirrored_defense(mods: Sequence[Any], plugins_dirs: Sequence[str]) -> tuple[dict[str, Any] | None, list[str]]:
    """The defense (name, params) whose ``mirrored_settings`` reads the mechanism of ``mods`` (None where none
    does), and one line per mod it cannot audit: one that no defense reads, or a second mechanism. A secure
    aggregation mod (``secure_aggregation``) changes who sees the update, not the update: it is passed over."""
    mods = [m for m in mods if secure_aggregation(m) is None]
    if not mods:
        return None, []
    registry = load_registry(plugins_dirs)
    kinds = [registry.get("defense", n) for n in registry.names("defense")]
    plain = getattr(Defense.mirrored_settings, "__func__", None)
    readers = ", ".join(k.name for k in kinds  # those that override mirrored_settings
                        if getattr(k.mirrored_settings, "__func__", None) is not plain)
    found: dict[str, Any] | None = None
    problems = []
    for i, mod in enumerate(mods):
        what = getattr(mod, "__name__", type(mod).__name__)
        read = next(((k.name, p) for k in kinds if (p := k.mirrored_settings(mod)) is not None), None)
        if read is None:
            problems.append(f"mods[{i}]: leakaudit cannot see what {what} does to the update (the defenses that "
                            f"read a framework's mechanism: {readers or 'none'}); leave it out of mods")
        elif found is not None:
            problems.append(f"mods[{i}]: a second mechanism ({what}); leakaudit audits one")
        else:
            found = {"name": read[0], "params": read[1]}
    return found, problems


class LeakAuditMod:
    """A Flower client mod: every ``every``-th round's update attacked before the reply leaves the client.

    ``model`` makes the network the app trains (``Net``, say): the mod loads the message's arrays into it
    to attack the round's update at the weights it was computed from. Each client writes
    ``out/client-NAME``, NAME its ``client_key`` in the node config (Flower's ``partition-id`` in simulation),
    else its node id. A round over more than ``max_images`` images is attacked on a seeded sample of its
    minibatches. The remaining keywords configure each client's ``LeakMonitor`` (defense, attacks, mean, std,
    metrics, leakage_metric, loggers, ...); they are checked now, one line per problem.

    ``mods`` are Flower mods run inside this one around the train function, as ``@app.train(mods=[...])`` runs
    them: a ``LocalDpMod`` among them is the audited defense (``flower_local_dp`` with its settings), its update
    drawn again by Flower's functions from the round's clean update on the monitor's own generator (the reply
    carries the mod's own draw); ``secaggplus_mod`` (or ``secagg_mod``) is read as secure aggregation: its stages
    that train nothing pass through, the round that trains is audited, and the report's threat box says that the
    server sees only the sum over the sampled clients; a mod leakaudit cannot read is refused in one line.
    """

    def __init__(self, model: Callable[[], nn.Module], *, out: str | Path = "runs/flower_clients", every: int = 1,
                 client_key: str = "partition-id", max_images: int = MAX_ROUND_IMAGES, mods: Sequence[Any] = (),
                 **monitor: Any) -> None:
        problems = [] if callable(model) else [f"model: a {type(model).__name__}; expected what makes the network "
                                               "the app trains (its class, say)"]
        problems += [] if isinstance(max_images, int) and max_images >= 1 else [
            f"max_images: {max_images!r}; expected a whole number >= 1"]
        mirrored, unread = mirrored_defense(mods, monitor.get("plugins_dirs", ()))
        problems += unread + (["defense: given beside mods; the mod's mechanism is the defense audited"]
                              if mirrored is not None and "defense" in monitor else [])
        if mirrored is not None:
            monitor["defense"] = mirrored
            if callable(model) and (why := integer_arrays_refusal("mods", model().state_dict())):
                problems.append(why)
        if problems:
            raise ConfigError([f"LeakAuditMod: {p}" for p in problems])
        LeakMonitor(**monitor, every=every, out=out)  # checks the settings now; writes nothing
        self.model, self.out, self.every, self.client_key = model, Path(out), every, client_key
        self.max_images, self._settings = max_images, monitor
        self.mods = list(mods)
        #: The secure aggregation protocols among ``mods`` ("SecAgg+"): the server sees only the sampled clients' sum.
        self.secure = [p for m in self.mods if (p := secure_aggregation(m)) is not None]
        self._fits: dict[str, int] = {}
        #: Each client's monitor of its last audited round in this process, by name (``monitors["0"].report()``).
        self.monitors: dict[str, LeakMonitor] = {}

    def __call__(self, msg: Message, context: Any, call_next: Callable[[Message, Any], Message]) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        name = str(context.node_config.get(self.client_key, context.node_id))
        config: dict[str, Any] = {k: v for record in msg.content.config_records.values() for k, v in record.items()}
        if not msg.content.array_records:  # a secure aggregation stage that trains nothing (keys, shares, unmask)
            return make_ffn(call_next, self.mods)(msg, context)
        self._fits[name] = self._fits.get(name, 0) + 1
        number = next((int(config[k]) for k in ROUND_KEYS if k in config), self._fits[name])
        if (number - 1) % self.every:
            return make_ffn(call_next, self.mods)(msg, context)
        monitor = self.monitors[name] = LeakMonitor(**self._settings, every=self.every,
                                                    out=self.out / f"client-{name}")
        monitor.max_images = self.max_images
        arrays = next(iter(msg.content.array_records.values())).to_numpy_ndarrays()
        clean: list[Any] = []

        def app(inner: Message, ctx: Any) -> Message:  # the app's own reply, before the mods inside change it
            out = call_next(inner, ctx)
            if not out.has_error() and out.content.array_records:
                clean.append(next(iter(out.content.array_records.values())).to_numpy_ndarrays())
            return out

        with monitor.observe_round(number) as local:
            reply = make_ffn(app, self.mods)(msg, context)
        if reply.has_error() or not clean:
            return reply
        try:  # a client's failed audit never costs its reply: the error is logged, and the reply leaves as it is
            model = self.model()
            model.load_state_dict({k: torch.as_tensor(a) for k, a in zip(model.state_dict(), arrays)})
            monitor.finish_round(local, model, clean[0], self._fits[name])
            if self.secure:
                monitor.aggregated(self._aggregation_line(context))
        except Exception as exc:
            monitor.log.warning("LeakAuditMod: client %s, round %d not audited: %s", name, number, one_line(exc))
        return reply

    def _aggregation_line(self, context: Any) -> str:
        """What secure aggregation leaves the server, for the report's threat box; the number of clients summed is
        the one SecAgg+'s setup stage kept in the client's state."""
        count = dict(context.state.config_records.get(SECAGG_STATE, {})).get("sample_num")
        clients = f"the {count} sampled clients'" if count else "the sampled clients'"
        return (f"{', '.join(self.secure)} (client mods): the server sees only the sum of {clients} masked updates; "
                "this client's update is attacked as one who gets it alone sees it, an upper bound (a server that "
                "defeats the aggregation, Pasquini et al. 2022); the mean's own leak: LeakAuditStrategy's aggregate")


class LeakAuditClient(NumPyClient):
    """``client``, with every ``monitor.every``-th round's update attacked inside its ``fit``.

    Build ``client`` on ``monitor.watch(trainloader)`` so the monitor sees the batches it trains on; ``model``
    is the ``nn.Module`` it trains. Checks the audit and opens the run folder now (ConfigError, one line per
    problem); a round over ``max_images`` images is attacked on a seeded sample of its minibatches.
    """

    def __init__(self, client: NumPyClient, monitor: LeakMonitor, model: nn.Module,
                 max_images: int = MAX_ROUND_IMAGES) -> None:
        if monitor.watched is None:
            raise ConfigError(["LeakAuditClient: the monitor watches no loader; build the client with "
                               "monitor.watch(trainloader) in place of trainloader"])
        monitor.bind_rounds(model, monitor.watched, max_images)
        self.client, self.monitor = client, monitor

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        return self.client.get_properties(config)

    def get_parameters(self, config: dict[str, Any]) -> list[Any]:
        return self.client.get_parameters(config)

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[Any], int, dict[str, Any]]:
        """The wrapped client's ``fit``; when the round is audited, its returned parameters are attacked before
        they are returned."""
        with self.monitor.local_round(config.get("server_round")) as local:
            sent, examples, metrics = self.client.fit(parameters, config)
            local.sent = sent
        return sent, examples, metrics

    def evaluate(self, parameters: list[Any], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        return self.client.evaluate(parameters, config)
