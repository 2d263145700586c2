"""Audit a Flower client's rounds before its update leaves it: wrap the NumPyClient in a LeakAuditClient.

Two simulated clients each hold 4 digits of their own and, in every round, train the digits CNN of
``digits_client.py`` for one local epoch in minibatches of 2 (FedAvg in Flower's simulation engine, on Ray,
with no network). Each client's monitor attacks the parameters its ``fit`` returns as FedAvg's update and
writes a run folder per client under ``runs/flower_training``, with its report at the end.

    pip install 'leakaudit[flower]'
    python examples/own_training/flower_training.py
"""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F
from flwr.app import Context
from flwr.client import ClientApp, NumPyClient
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import run_simulation
from torch.utils.data import DataLoader, TensorDataset

from leakaudit import LeakMonitor, report_folder
from leakaudit.flower import LeakAuditClient

from digits_client import build_model, load_data

LR = 0.05
CLIENT_IMAGES = 4   # each client's own training digits
ATTACKS = [{"name": "inverting_gradients", "params": {"iterations": 300}}]


def get_weights(net: torch.nn.Module) -> list:
    return [v.cpu().numpy() for v in net.state_dict().values()]


def set_weights(net: torch.nn.Module, parameters: list) -> None:
    net.load_state_dict(OrderedDict(zip(net.state_dict(), map(torch.as_tensor, parameters))), strict=True)


class DigitsClient(NumPyClient):
    """A plain Flower client: it makes its optimizer inside ``fit`` and runs one local epoch."""

    def __init__(self, net: torch.nn.Module, trainloader: DataLoader) -> None:
        self.net, self.trainloader = net, trainloader

    def get_parameters(self, config: dict) -> list:
        return get_weights(self.net)

    def fit(self, parameters: list, config: dict) -> tuple[list, int, dict]:
        set_weights(self.net, parameters)
        optimizer = torch.optim.SGD(self.net.parameters(), lr=LR)
        for x, y in self.trainloader:
            optimizer.zero_grad()
            F.cross_entropy(self.net(x), y).backward()
            optimizer.step()
        return get_weights(self.net), len(self.trainloader.dataset), {}


def client_app(out: str, every: int) -> ClientApp:
    """Each simulated client: its own 4 digits, wrapped so that its rounds are audited into its own folder."""
    def client_fn(context: Context):
        client_id = int(context.node_config["partition-id"])
        data = load_data()
        mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
        own = slice(client_id * CLIENT_IMAGES, (client_id + 1) * CLIENT_IMAGES)
        trainloader = DataLoader(TensorDataset((data.train_x[own] - mean) / std, data.train_y[own]), batch_size=2,
                                 shuffle=True, generator=torch.Generator().manual_seed(client_id))

        monitor = LeakMonitor(attacks=ATTACKS, every=every, out=f"{out}/client-{client_id}", mean=data.mean,
                              std=data.std)                          # the loader normalised with these
        client = DigitsClient(build_model(), monitor.watch(trainloader))
        return LeakAuditClient(client, monitor, client.net).to_client()

    return ClientApp(client_fn=client_fn)


def server_app(rounds: int) -> ServerApp:
    """FedAvg over both clients, sending each round's number in the fit config (the rows are numbered by it)."""
    def server_fn(context: Context) -> ServerAppComponents:
        strategy = FedAvg(min_available_clients=2, fraction_evaluate=0.0,
                          on_fit_config_fn=lambda server_round: {"server_round": server_round})
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    return ServerApp(server_fn=server_fn)


def main(out: str = "runs/flower_training", rounds: int = 3, every: int = 1) -> list:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Flower's simulation starts Ray: keep it offline
    run_simulation(server_app=server_app(rounds), client_app=client_app(out, every), num_supernodes=2,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    summaries = []
    for folder in sorted(Path(out).glob("client-*")):
        summary = report_folder(folder)
        for cell in summary.cells:
            print(f"{folder.name}, round {cell.checkpoint}: {cell.attack} rebuilds its images at "
                  f"{cell.mean('psnr'):.1f} dB PSNR")
        summaries.append(summary)
    print(f"reports: {out}/client-*/report.html")
    return summaries


if __name__ == "__main__":
    main()
