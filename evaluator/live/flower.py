"""LeakMonitor on a Flower client: each round's update attacked before it leaves (install ``leakaudit[flower]``).

``LeakAuditClient`` wraps a ``NumPyClient``. Around the wrapped client's ``fit`` it watches every optimizer
step on the model, whichever optimizer ``fit`` makes, and attacks the parameters ``fit`` returns as the
round's FedAvg update over the batches the watched loader gave (``LeakMonitor.local_round``). Rounds are
numbered by the ``server_round`` of the fit config when the strategy sends it, else by the client's own
count of rounds it took part in, kept in its run folder.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.live.monitor import MAX_ROUND_IMAGES, LeakMonitor

try:
    from flwr.client import NumPyClient
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("leakaudit's Flower client needs Flower: pip install 'leakaudit[flower]'") from exc


class LeakAuditClient(NumPyClient):
    """``client``, with every ``monitor.every``-th round's update attacked inside its ``fit``.

    Build ``client`` on ``monitor.watch(trainloader)`` so the monitor sees the batches it trains on; ``model``
    is the ``nn.Module`` it trains. Checks the audit and opens the run folder now (ConfigError, one line per
    problem); ``max_images`` caps the images of a round the attacks take on (rounds over it are skipped,
    with a warning).
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
