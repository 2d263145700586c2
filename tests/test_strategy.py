"""LeakAuditStrategy: the server's view of a Flower federation. Each client's update and their mean are attacked
beside the wrapped strategy, whose aggregate stays the same."""
from __future__ import annotations

import json
from html import escape

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("flwr")
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.server.client_manager import SimpleClientManager  # noqa: E402
from flwr.server.client_proxy import ClientProxy  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402

import leakaudit  # noqa: E402
from leakaudit.flower import LeakAuditStrategy  # noqa: E402
from leakaudit.plugins.manager import load_registry  # noqa: E402

CLIENTS, LR = 4, 0.1


class Proxy(ClientProxy):
    """A client the server can sample; the test runs its fit itself."""

    def get_properties(self, ins, timeout, group_id):
        raise NotImplementedError

    def get_parameters(self, ins, timeout, group_id):
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Sigmoid(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))


def _loaders():
    data = load_registry(entry_points=False).get("dataset", "digits").load(image_size=16, root=None, download=False)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    x = (data.train_x[:CLIENTS] - mean) / std
    return {str(i): DataLoader(TensorDataset(x[i:i + 1], data.train_y[i:i + 1]), batch_size=1)
            for i in range(CLIENTS)}, mean, std


def _fit(model: nn.Module, weights: list, loader, config: dict) -> list:
    """A client's fit: its local epochs of SGD at the config's learning rate, from the global weights."""
    model.load_state_dict({k: torch.as_tensor(w) for k, w in zip(model.state_dict(), weights)})
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for _ in range(config["local_epochs"]):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return [v.detach().numpy().copy() for v in model.state_dict().values()]


@pytest.mark.slow
def test_the_server_attacks_each_client_and_their_mean_and_aggregates_as_before(tmp_path):
    loaders, mean, std = _loaders()
    model = _model()
    start = ndarrays_to_parameters([v.detach().numpy() for v in model.state_dict().values()])
    config = {"lr": LR, "local_epochs": 1}
    wrapped = FedAvg(min_fit_clients=CLIENTS, min_available_clients=CLIENTS, on_fit_config_fn=lambda r: config)
    strategy = LeakAuditStrategy(wrapped, model, loaders.__getitem__, out=tmp_path, mean=mean, std=std,
                                 attacks=[{"name": "inverting_gradients", "params": {"iterations": 200}}],
                                 known_labels=True)
    manager = SimpleClientManager()
    for i in range(CLIENTS):
        manager.register(Proxy(f"node-{i}"))
    instructions = strategy.configure_fit(1, start, manager)
    assert len(instructions) == CLIENTS and all(ins.config == config for _, ins in instructions)
    results = []
    for proxy, ins in instructions:
        name = proxy.cid.removeprefix("node-")
        sent = _fit(_model(), parameters_to_ndarrays(ins.parameters), loaders[name], ins.config)
        results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(sent), 1, {"partition": name})))
    aggregated, _ = strategy.aggregate_fit(1, results, [])
    alone, _ = FedAvg().aggregate_fit(1, results, [])
    for a, b in zip(parameters_to_ndarrays(aggregated), parameters_to_ndarrays(alone)):
        np.testing.assert_array_equal(a, b)  # the wrapped strategy's aggregate, unchanged

    summaries = strategy.report()
    assert sorted(summaries) == ["0", "1", "2", "3", "aggregate"]
    client = {name: s.cell("none", "inverting_gradients", 1).mean("psnr") for name, s in summaries.items()}
    rows = [json.loads(line) for line in (tmp_path / "client-0" / "results.jsonl").read_text().splitlines()]
    assert [(r["checkpoint"], r["attack"]) for r in rows] == [(1, "inverting_gradients")]
    assert all(summaries[n].worst("none").verdict == "leaks" for n in "0123")
    # the mean of four updates hides each image better than one client's own update
    assert client["aggregate"] < np.mean([client[n] for n in "0123"]) - 3.0  # measured: 21.4 against 26.2 dB
    rounds = json.loads((tmp_path / "aggregate" / "monitor.json").read_text())["rounds"]
    assert rounds["1"]["clients"] == CLIENTS and rounds["1"]["images"] == CLIENTS


def test_a_round_the_config_cannot_describe_is_skipped_with_a_warning(tmp_path):
    loaders, mean, std = _loaders()
    model = _model()
    start = ndarrays_to_parameters([v.detach().numpy() for v in model.state_dict().values()])
    strategy = LeakAuditStrategy(FedAvg(min_fit_clients=2, min_available_clients=2), model, loaders.__getitem__,
                                 out=tmp_path, mean=mean, std=std)
    manager = SimpleClientManager()
    for i in range(2):
        manager.register(Proxy(str(i)))
    instructions = strategy.configure_fit(1, start, manager)
    results = [(p, FitRes(Status(Code.OK, ""), ins.parameters, 1, {})) for p, ins in instructions]
    with pytest.warns(UserWarning, match="its config has no 'lr'"):
        strategy.aggregate_fit(1, results, [])
    assert strategy.report() == {}


def test_bad_settings_are_one_line_each_before_any_round():
    from leakaudit.evaluator.audit.types import ConfigError

    with pytest.raises(ConfigError) as info:
        LeakAuditStrategy(FedAvg(), _model(), "not a function", every=0)
    assert info.value.lines == ["LeakAuditStrategy: every: 0; expected a whole number >= 1",
                                "LeakAuditStrategy: client_loader: expected a function of a client's name"]
    with pytest.raises(ConfigError) as info:
        LeakAuditStrategy("FedAvg", _model(), lambda name: None, local_epochs=0)
    assert info.value.lines == ["LeakAuditStrategy: strategy: a str; expected a Flower Strategy "
                                "(flwr.serverapp.strategy or flwr.server.strategy)",
                                "LeakAuditStrategy: local_epochs: 0; expected a whole number >= 1"]


def test_a_client_and_the_server_judge_one_update_alike(tmp_path):
    """A client whose whole data is the attacked batch and the server that receives its update, each given the
    attacker's own images (prior=): one guess, one threshold, one verdict (they were 9.08 against 11.86)."""
    data = load_registry(entry_points=False).get("dataset", "digits").load(image_size=16, root=None, download=False)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    x = (data.train_x[:68] - mean) / std
    loader = DataLoader(TensorDataset(x[:4], data.train_y[:4]), batch_size=4)
    prior = TensorDataset(x[4:], data.train_y[4:68])
    audit = {"attacks": [{"name": "inverting_gradients", "params": {"iterations": 30}}], "mean": mean.flatten(),
             "std": std.flatten(), "prior": prior}
    from leakaudit import LeakMonitor

    model = _model()
    start = [v.detach().numpy().copy() for v in model.state_dict().values()]
    client = LeakMonitor(out=tmp_path / "client", **audit)
    watched = client.watch(loader)
    client.bind_rounds(model, loader)
    with client.local_round(1):
        sent = _fit(model, start, watched, {"lr": LR, "local_epochs": 1})
    config, aggregated = {"lr": LR, "local_epochs": 1}, []
    wrapped = FedAvg(min_fit_clients=1, min_available_clients=1, on_fit_config_fn=lambda r: config,
                     fit_metrics_aggregation_fn=lambda metrics: aggregated.extend(metrics) or {})
    server = LeakAuditStrategy(wrapped, _model(), {"0": loader}.__getitem__, out=tmp_path / "server", **audit)
    manager = SimpleClientManager()
    manager.register(Proxy("node-0"))
    ((proxy, ins),) = server.configure_fit(1, ndarrays_to_parameters(start), manager)
    server.aggregate_fit(1, [(proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(sent), 4,
                                            {"partition": "0", "loss": 0.5}))], [])
    assert aggregated == [(4, {"loss": 0.5})]  # the client's name reached the audit, not Flower's metrics
    assert json.loads((tmp_path / "server" / "client-0" / "monitor.json").read_text())["every"] == 1
    mine, theirs = client.report(), server.report()["0"]
    assert mine.leak_threshold == theirs.leak_threshold and mine.leak_threshold.guess == "class_mean"
    assert mine.label_threshold == theirs.label_threshold and mine.label_threshold.guess == "mean"
    assert [(v.verdict, v.reason) for v in mine.verdicts] == [(v.verdict, v.reason) for v in theirs.verdicts]


def test_a_wrapped_flower_dp_strategy_is_read_and_each_update_attacked_as_the_global_model_shows_it(tmp_path):
    """DifferentialPrivacyServerSideFixedClipping noises the mean after the server holds each update: the client's
    update is attacked under flower_fixed_clipping with the strategy's own settings, beside the update as held."""
    from flwr.server.strategy import DifferentialPrivacyServerSideFixedClipping

    loaders, mean, std = _loaders()
    model = _model()
    start = [v.detach().numpy().copy() for v in model.state_dict().values()]
    config = {"lr": LR, "local_epochs": 1}
    dp = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(min_fit_clients=1, min_available_clients=1, on_fit_config_fn=lambda r: config),
        noise_multiplier=0.8, clipping_norm=0.5, num_sampled_clients=1)
    server = LeakAuditStrategy(dp, model, loaders.__getitem__, out=tmp_path, mean=mean, std=std, aggregate=False,
                               attacks=[{"name": "inverting_gradients", "params": {"iterations": 5}}])
    with pytest.raises(leakaudit.ConfigError, match="^LeakAuditStrategy: defense: given beside "
                                                       "DifferentialPrivacyServerSideFixedClipping"):
        LeakAuditStrategy(dp, model, loaders.__getitem__, out=tmp_path, defense="none")
    manager = SimpleClientManager()
    manager.register(Proxy("node-0"))
    ((proxy, ins),) = server.configure_fit(1, ndarrays_to_parameters(start), manager)
    sent = _fit(_model(), start, loaders["0"], config)
    server.aggregate_fit(1, [(proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(sent), 1,
                                            {"partition": "0"}))], [])
    settings = {json.loads(line)["setting"] for line in (tmp_path / "client-0" / "results.jsonl").read_text().splitlines()}
    assert settings == {"none", "flower_fixed_clipping(clipping_norm=0.5,noise_multiplier=0.8,num_sampled_clients=1,"
                                "side=server)"}


class _Nodes:
    """Flower's Grid as a strategy's configure_train reads it: the ids of the connected nodes."""

    def __init__(self, count: int) -> None:
        self.count = count

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.count + 1))


@pytest.mark.slow  # 16 s: two rounds, two clients, two reports
def test_flowers_accountant_is_shown_beside_leakaudits_own_and_a_wrong_population_is_flagged(tmp_path, monkeypatch):
    """A Message-API DP strategy with Flower's RdpAccountant told of 100 clients, over a federation of 2: its
    claimed epsilon over the 2 releases beside leakaudit's own (1 / noise_multiplier GDP composed over them), the
    population flagged; each client's table composed over the 2 rounds it took part in."""
    pytest.importorskip("dp_accounting")  # Flower's RdpAccountant: pip install 'flwr[dp]'
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping
    from flwr.serverapp.strategy import FedAvg as MessageFedAvg
    from flwr.supercore.task_identity import TaskIdentity

    from leakaudit.plugins.defense import PrivacyProfile

    for field in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, field, 7, raising=False)
    loaders, mean, std = _loaders()
    accountant = RdpAccountant(PrivacyConfig(target_delta=1e-5, population_size=100, sampling_method=SamplingMethod(
        "no-amplification"), neighboring_relation=NeighboringRelation("add-or-remove-one")))
    dp = DifferentialPrivacyServerSideFixedClipping(MessageFedAvg(fraction_train=1.0, min_available_nodes=2,
                                                                  min_train_nodes=2), noise_multiplier=1.0,
                                                    clipping_norm=0.5, num_sampled_clients=2, accountant=accountant)
    model = _model()
    server = LeakAuditStrategy(dp, model, loaders.__getitem__, out=tmp_path, mean=mean, std=std, aggregate=False,
                               attacks=[{"name": "inverting_gradients", "params": {"iterations": 5}}])
    arrays = ArrayRecord(model.state_dict())
    for server_round in (1, 2):
        replies = []
        for message in server.configure_train(server_round, arrays, ConfigRecord({"lr": LR}), _Nodes(2)):
            name = str(message.metadata.dst_node_id - 1)
            sent = _fit(_model(), arrays.to_numpy_ndarrays(), loaders[name], {"lr": LR, "local_epochs": 1})
            replies.append(Message(content=RecordDict({"arrays": ArrayRecord(sent), "metrics": MetricRecord(
                {"num-examples": 1, "partition": int(name)})}), reply_to=message))
        arrays, _ = server.aggregate_train(server_round, replies)
    summary = server.report()["0"]
    noisy = next(w for w in summary.worst_case if w.defense == "flower_fixed_clipping")
    flower, own = accountant.get_privacy_spent().epsilon, PrivacyProfile(mu=1.0).epsilon(1e-5, 2)
    assert 7.0 < flower < 7.2 and own == pytest.approx(6.573, abs=1e-3)  # RDP's bound above the exact GDP one
    assert noisy.epsilon == pytest.approx(own, rel=1e-9) and "1 over 2 rounds" not in noisy.privacy.mechanism
    assert f"{own:.3g} over 2 rounds" in noisy.privacy.mechanism
    claim, *mismatches = noisy.privacy.claimed
    assert claim.startswith(f"Flower's accountant (rdp, no-amplification, population_size 100) claims epsilon "
                            f"{flower:.4g} at delta 1e-05 over 2 releases; leakaudit's own accounting of the same "
                            f"releases: epsilon {own:.4g}")
    assert mismatches == ["MISMATCH: the accountant's population_size 100 is not the 2 nodes the strategy samples "
                          "from: an epsilon amplified by sampling would be wrong"]
    page = (tmp_path / "client-0" / "report.html").read_text()
    assert escape(mismatches[0]).replace("&#x27;", "&#39;") in page and f"claims epsilon {flower:.4g}" in page
    assert f'data-label="epsilon">{own:.3g}<' in page  # the verdict table's epsilon: composed, not "no guarantee"
