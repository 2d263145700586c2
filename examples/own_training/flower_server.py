"""Audit a Flower federation from the server, where its attacker sits: wrap the strategy in a LeakAuditStrategy.

Four simulated clients each hold 2 digits of their own and, in every round, train the digits CNN of
``digits_client.py`` for the local epochs and at the learning rate the server's fit config names (FedAvg in
Flower's simulation engine, on Ray, with no network). The server attacks each client's update as it arrives,
and the mean of the four, what it would see under secure aggregation. The strategy's aggregate is FedAvg's,
unchanged. A server holds no images: to score the attacks, this simulation gives the strategy each client's
loader (the one it trains on, in the same order), and each client names its partition in its fit metrics.

    pip install 'leakaudit[flower]'
    python examples/own_training/flower_server.py
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from flwr.app import Context
from flwr.client import ClientApp, NumPyClient
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import run_simulation
from torch.utils.data import DataLoader, TensorDataset

from leakaudit.flower import LeakAuditStrategy

from digits_client import build_model, load_data
from flower_training import get_weights, set_weights

CLIENTS = 4
CLIENT_IMAGES = 2   # each client's own training digits
FIT_CONFIG = {"lr": 0.05, "local_epochs": 1}
ATTACKS = [{"name": "inverting_gradients", "params": {"iterations": 300}}]


def client_loader(partition: str) -> DataLoader:
    """A client's own digits, normalised, in minibatches of 2, in a fixed order."""
    data = load_data()
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    own = slice(int(partition) * CLIENT_IMAGES, (int(partition) + 1) * CLIENT_IMAGES)
    return DataLoader(TensorDataset((data.train_x[own] - mean) / std, data.train_y[own]), batch_size=2)


class ConfiguredClient(NumPyClient):
    """A plain Flower client that trains as the server's fit config says and names its partition."""

    def __init__(self, partition: str) -> None:
        self.partition, self.net, self.loader = partition, build_model(), client_loader(partition)

    def get_parameters(self, config: dict) -> list:
        return get_weights(self.net)

    def fit(self, parameters: list, config: dict) -> tuple[list, int, dict]:
        set_weights(self.net, parameters)
        optimizer = torch.optim.SGD(self.net.parameters(), lr=float(config["lr"]))
        for _ in range(int(config["local_epochs"])):
            for x, y in self.loader:
                optimizer.zero_grad()
                F.cross_entropy(self.net(x), y).backward()
                optimizer.step()
        return get_weights(self.net), len(self.loader.dataset), {"partition": self.partition}


def main(out: str = "runs/flower_server", rounds: int = 2, every: int = 1) -> dict:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Flower's simulation starts Ray: keep it offline
    data = load_data()
    strategy = LeakAuditStrategy(
        FedAvg(min_available_clients=CLIENTS, min_fit_clients=CLIENTS, fraction_evaluate=0.0,
               on_fit_config_fn=lambda server_round: FIT_CONFIG),
        build_model(), client_loader, out=out, every=every, attacks=ATTACKS, mean=data.mean, std=data.std)

    def server_fn(context: Context) -> ServerAppComponents:
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    def client_fn(context: Context):
        return ConfiguredClient(str(context.node_config["partition-id"])).to_client()

    run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=ClientApp(client_fn=client_fn),
                   num_supernodes=CLIENTS, backend_config={"client_resources": {"num_cpus": 1},
                                                           "init_args": {"num_cpus": 2}})
    summaries = strategy.report()
    for name, summary in summaries.items():
        for cell in summary.cells:
            print(f"{name}, round {cell.checkpoint}: {cell.attack} rebuilds its images at "
                  f"{cell.mean('psnr'):.1f} dB PSNR ({summary.worst_case[0].verdict})")
    print(f"reports: {out}/client-*/report.html and {out}/aggregate/report.html")
    return summaries


if __name__ == "__main__":
    main()
