"""LeakMonitor inside Lightning's Trainer.fit and a Flower client (the optional extras)."""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import leakaudit
from conftest import flower_train_round

sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "own_training"))
from digits_client import load_data  # noqa: E402  (the example client)

ATTACK = [{"name": "inverting_gradients", "params": {"iterations": 300}}]


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def normalised(data) -> TensorDataset:
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    return TensorDataset((data.train_x - mean) / std, data.train_y)


@pytest.mark.slow
def test_lightning_callback_attacks_the_steps_of_trainer_fit(tmp_path):
    import lightning.pytorch as pl

    from leakaudit.lightning import LeakAuditCallback

    from lightning_training import DigitsClassifier
    from lightning.pytorch.loggers import CSVLogger

    data = load_data()
    loader = DataLoader(normalised(data), batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(0))
    monitor = leakaudit.LeakMonitor(attacks=ATTACK, every=3, out=tmp_path / "run", mean=data.mean, std=data.std)
    trainer = pl.Trainer(max_steps=4, callbacks=[LeakAuditCallback(monitor)], accelerator="cpu",
                         logger=CSVLogger(tmp_path / "logs", name="digits"), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(DigitsClassifier(), loader)
    found = {r["checkpoint"]: r for r in rows(tmp_path / "run")}
    assert sorted(found) == [0, 3]
    baselines = json.loads((tmp_path / "run" / "baselines.json").read_text())
    assert found[0]["psnr"] > baselines["random"]["psnr"] + 15
    assert (tmp_path / "run" / "report.html").is_file()  # written when training ended
    logged = (tmp_path / "logs" / "digits" / "version_0" / "metrics.csv").read_text().splitlines()
    columns = logged[0].split(",")  # the Trainer's logger holds each audited step's scalars
    psnr = [line.split(",")[columns.index("leakaudit/psnr")] for line in logged[1:]]
    steps = [line.split(",")[columns.index("step")] for line in logged[1:]]
    assert [s for s, v in zip(steps, psnr) if v] == ["0", "3"]
    assert float(psnr[0]) == pytest.approx(found[0]["psnr"], abs=1e-4)


@pytest.mark.slow
def test_the_examples_run(tmp_path):
    import lightning_training
    import monitored_training

    plain = monitored_training.main(out=str(tmp_path / "plain"), steps=4, every=3, board=str(tmp_path / "board"))
    assert plain.checkpoints == [0, 3] and plain.worst_case[0].verdict == "leaks"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "board"))
    events.Reload()
    assert [e.step for e in events.Scalars("leakaudit/psnr")] == [0, 3]
    assert [e.value for e in events.Scalars("leakaudit/leaks")] == [1.0, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inside = lightning_training.main(out=str(tmp_path / "lightning"), steps=4, every=3,
                                         board=str(tmp_path / "lightning_board"))
    assert inside.checkpoints == [0, 3] and inside.worst_case[0].verdict == "leaks"
    events = EventAccumulator(str(tmp_path / "lightning_board" / "lightning_training" / "version_0"))
    events.Reload()
    assert [e.step for e in events.Scalars("leakaudit/psnr")] == [0, 3]


# --- Flower -----------------------------------------------------------------------------------------------


def flower_client(tmp_path, every=1, seed=0, **monitor_args):
    """The example's Flower client on 4 digits, wrapped; with the loader's batch order it will draw."""
    from leakaudit.flower import LeakAuditClient

    import flower_training
    from digits_client import build_model

    data = load_data()
    items = TensorDataset(*normalised(data)[:4])
    loader = DataLoader(items, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(seed))
    order = list(DataLoader(items, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(seed)))
    monitor = leakaudit.LeakMonitor(attacks=ATTACK, every=every, out=tmp_path / "run", mean=data.mean,
                                    std=data.std, **monitor_args)
    client = flower_training.DigitsClient(build_model(), monitor.watch(loader))
    return LeakAuditClient(client, monitor, client.net), order


@pytest.mark.slow
def test_flower_client_attacks_the_fedavg_update_it_returns(tmp_path):
    from leakaudit.evaluator.results.report import threat_model
    from leakaudit.evaluator.results.rundir import saved_audit
    from leakaudit.plugins.protocol import FedAvg, fedavg_update

    import flower_training
    from digits_client import build_model

    wrapped, order = flower_client(tmp_path, every=2)
    received = flower_training.get_weights(build_model(seed=1))
    sent, examples, _ = wrapped.fit(received, {"server_round": 1})
    assert examples == 4
    net = wrapped.client.net
    index = {name: i for i, name in enumerate(net.state_dict())}
    names = [n for n, _ in net.named_parameters()]
    expected = [torch.as_tensor(received[index[n]] - sent[index[n]]) for n in names]
    update = wrapped.monitor.last_update
    assert all(torch.equal(u, e) for u, e in zip(update, expected))  # what leaves the client, exactly

    flower_training.set_weights(net, received)  # FedAvg's attacker, unrolled over the batches in the order drawn
    x, y = torch.cat([b[0] for b in order]), torch.cat([b[1] for b in order])
    unrolled = fedavg_update(net, torch.nn.functional.cross_entropy, x, y,
                             FedAvg(local_epochs=1, local_batch_size=2, local_lr=flower_training.LR))
    assert max(float((u - r).detach().abs().max()) for u, r in zip(update, unrolled)) < 1e-5

    described = json.loads((tmp_path / "run" / "monitor.json").read_text())
    assert described["rounds"]["1"] == {"local_epochs": 1, "local_batch_size": 2, "local_lr": flower_training.LR,
                                        "clients": 1, "shuffle": False, "secure_aggregation": "sum",
                                        "images": 4, "optimizer": "SGD()"}
    found = rows(tmp_path / "run")
    baselines = json.loads((tmp_path / "run" / "baselines.json").read_text())
    assert [r["checkpoint"] for r in found] == [1] and found[0]["psnr"] > baselines["random"]["psnr"] + 10
    assert dict(threat_model(saved_audit(tmp_path / "run")))["Protocol"].startswith(
        "fedavg (local_epochs=1, local_batch_size=2, local_lr=0.05); one update of 4 private image(s)")

    wrapped.fit(sent, {"server_round": 2})  # every=2: rounds 1, 3, 5, ... are attacked
    assert [r["checkpoint"] for r in rows(tmp_path / "run")] == [1]
    assert json.loads((tmp_path / "run" / "monitor.json").read_text())["fits"] == 2


def test_flower_round_that_fedavg_cannot_describe_is_skipped_with_a_warning(tmp_path):
    import flower_training

    wrapped, _ = flower_client(tmp_path)
    client = wrapped.client

    def fit_with_decay(parameters, config):  # the lr changes between the two local steps
        flower_training.set_weights(client.net, parameters)
        optimizer = torch.optim.SGD(client.net.parameters(), lr=0.05)
        decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for x, y in client.trainloader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(client.net(x), y).backward()
            optimizer.step()
            decay.step()
        return flower_training.get_weights(client.net), 4, {}

    client.fit = fit_with_decay
    with pytest.warns(UserWarning, match=r"round 1 not attacked: the learning rate varied within the round "
                                         r"\(0.025, 0.05\); FedAvg has one"):
        wrapped.fit(flower_training.get_weights(client.net), {})
    described = json.loads((tmp_path / "run" / "monitor.json").read_text())
    assert described["steps"] == [] and "learning rate varied" in described["skipped"]["1"]
    assert not (tmp_path / "run" / "results.jsonl").exists() or not rows(tmp_path / "run")


def test_flower_client_refuses_before_any_round(tmp_path):
    from opacus import GradSampleModule

    from leakaudit.flower import LeakAuditClient

    import flower_training
    from digits_client import build_model

    monitor = leakaudit.LeakMonitor(attacks=ATTACK, out=tmp_path / "a", mean=0.5, std=0.5)
    loader = DataLoader(TensorDataset(torch.rand(4, 1, 16, 16), torch.arange(4)), batch_size=2)
    with pytest.raises(leakaudit.ConfigError, match="the monitor watches no loader; build the client with "
                                                    r"monitor.watch\(trainloader\)"):
        LeakAuditClient(flower_training.DigitsClient(build_model(), loader), monitor, build_model())
    with pytest.raises(leakaudit.ConfigError, match=r"LeakMonitor: max_images: 0; expected a whole number >= 1"):
        LeakAuditClient(flower_training.DigitsClient(build_model(), monitor.watch(loader)), monitor, build_model(),
                        max_images=0)
    private = GradSampleModule(build_model())
    with pytest.raises(leakaudit.ConfigError, match="model: an Opacus GradSampleModule; DP-SGD inside federated "
                                                    "rounds is not audited yet"):
        LeakAuditClient(flower_training.DigitsClient(private, monitor.watch(loader)), monitor, private)
    assert not (tmp_path / "a").exists()  # refused before any work
    with pytest.raises(leakaudit.RunError, match=r"LeakMonitor.local_round: call bind_rounds\(model, loader\) first"):
        with monitor.local_round(1):
            pass


# slow: the older NumPyClient path in Flower's simulation; in-process tests cover LeakAuditClient and the
# Message-API app runs in the simulation by default
@pytest.mark.heavy
def test_flower_simulation_audits_every_client_round(tmp_path, monkeypatch):
    import flower_training

    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # Flower's Ray backend rewrites it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summaries = flower_training.main(out=str(tmp_path / "sim"), rounds=2, every=1)
    assert len(summaries) == 2  # one run folder per simulated client
    for summary in summaries:
        assert summary.checkpoints == [1, 2] and summary.worst_case[0].verdict == "leaks"


@pytest.mark.heavy
def test_flower_simulation_audited_from_the_server(tmp_path, monkeypatch):
    """Four clients in Flower's simulation, LeakAuditStrategy on the server: every client's update leaks, and
    the mean of the four (the view under secure aggregation) leaks less than the clients' own updates."""
    import flower_server

    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # Flower's Ray backend rewrites it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summaries = flower_server.main(out=str(tmp_path / "server"), rounds=2, every=1)
    assert sorted(summaries) == ["0", "1", "2", "3", "aggregate"]
    for summary in summaries.values():
        assert summary.checkpoints == [1, 2] and summary.worst_case[0].verdict == "leaks"
    psnr = {name: s.worst_case[0].mean("psnr") for name, s in summaries.items()}
    assert psnr["aggregate"] < min(psnr[n] for n in "0123") - 2.0  # measured: 23.7 against 28.2 to 29.8 dB


FLOWER_APP = Path(__file__).parents[1] / "examples" / "own_training" / "flower_app"


def _flower_app(monkeypatch, tmp_path, images: int) -> None:
    """The quickstart-shaped app importable, its partitions cut to ``images``, its attacks cheap."""
    for name, value in (("FLOWER_APP_IMAGES", images), ("FLOWER_APP_ITERATIONS", 20),
                        ("FLOWER_APP_RUNS", tmp_path / "runs")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FLOWER_APP), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(FLOWER_APP))
    for module in ("task", "client_app", "server_app", "simulate"):
        sys.modules.pop(module, None)


def test_flower_app_mod_attacks_the_round_the_reply_carries(tmp_path, monkeypatch):
    """LeakAuditMod around the quickstart's @app.train function: the update attacked is the message's arrays
    minus the reply's, over the batches the app's own DataLoader gave."""
    _flower_app(monkeypatch, tmp_path, images=40)  # 32 training images: one round of one minibatch
    import client_app
    from leakaudit.flower import LeakAuditMod
    from task import Net

    mod = LeakAuditMod(Net, **client_app.AUDIT)
    start = Net()
    reply = mod(*flower_train_round(monkeypatch, start.state_dict(), 3), client_app.train)
    returned = reply.content["arrays"].to_torch_state_dict()
    monitor = mod.monitors["0"]
    assert monitor.audited_steps == [3]
    expected = [start.state_dict()[n] - returned[n] for n, _ in start.named_parameters()]
    assert all(torch.allclose(a, b) for a, b in zip(monitor.last_update, expected))
    described = json.loads((tmp_path / "runs" / "clients" / "client-0" / "monitor.json").read_text())
    assert described["rounds"]["3"] | {"optimizer": None} == {"local_epochs": 1, "local_batch_size": 32,
                                                             "local_lr": 0.01, "clients": 1, "shuffle": False,
                                                             "secure_aggregation": "sum", "images": 32,
                                                             "optimizer": None}
    assert described["rounds"]["3"]["optimizer"] == "SGD(momentum=0.9)" and not described.get("sampled")


def test_flower_mod_refuses_bad_settings_before_any_round(tmp_path):
    from leakaudit.flower import LeakAuditMod

    with pytest.raises(leakaudit.ConfigError) as info:
        LeakAuditMod("Net", max_images=0, out=tmp_path / "runs")
    assert info.value.lines == ["LeakAuditMod: model: a str; expected what makes the network the app trains (its "
                                "class, say)", "LeakAuditMod: max_images: 0; expected a whole number >= 1"]
    with pytest.raises(leakaudit.ConfigError, match=r"^LeakMonitor: every: 0; expected a whole number >= 1$"):
        LeakAuditMod(torch.nn.Linear, every=0, out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()  # nothing written


def test_secaggplus_mod_is_read_as_secure_aggregation_and_its_stages_pass_through(tmp_path, monkeypatch):
    """secaggplus_mod inside LeakAuditMod is not refused; a SecAgg+ stage that carries no arrays (setup, keys,
    unmasking) reaches the mod and counts no round."""
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict
    from flwr.client.mod import secaggplus_mod

    from leakaudit.flower import LeakAuditMod

    mod = LeakAuditMod(torch.nn.Linear, mods=[secaggplus_mod], out=tmp_path / "runs", mean=0.5, std=0.5)
    assert mod.secure == ["SecAgg+"]
    _, context = flower_train_round(monkeypatch, {}, 1)  # a SuperNode's context, Flower's task identity set
    stage = Message(content=RecordDict({"secaggplus_configs": ConfigRecord({"stage": "setup"})}), dst_node_id=7,
                    message_type=MessageType.TRAIN)
    seen = []
    mod.mods = [lambda msg, ctx, call_next: seen.append(msg) or call_next(msg, ctx)]  # the stage reaches the mods
    reply = mod(stage, context, lambda msg, ctx: Message(RecordDict(), reply_to=msg))
    assert seen == [stage] and not reply.has_error() and mod.monitors == {} and not (tmp_path / "runs").exists()


@pytest.mark.heavy  # 45 s of Flower's simulation; the mod's exactness around the app's own train stays in the default tier
def test_flower_app_on_the_message_api_is_audited_on_both_sides(tmp_path, monkeypatch):
    """Flower's current quickstart structure (ClientApp with @app.train, ServerApp with strategy.start), each
    side audited with at most five added lines; clients of 96 images are attacked on a seeded sample."""
    for side in ("client_app.py", "server_app.py"):
        added = [line for line in (FLOWER_APP / side).read_text().splitlines()
                 if "# leakaudit" in line and not line.startswith('"""')]  # code lines, not the docstring
        assert 1 <= len(added) <= 5, side
    _flower_app(monkeypatch, tmp_path, images=120)
    import simulate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        simulate.main()
    runs = tmp_path / "runs"
    folders = [runs / "clients" / "client-0", runs / "clients" / "client-1", runs / "server" / "client-0",
               runs / "server" / "client-1", runs / "server" / "aggregate"]
    for folder in folders:
        described = json.loads((folder / "monitor.json").read_text())
        assert sorted(described["steps"]) == [1, 2], folder
        images = 128 if folder.name == "aggregate" else 64
        assert all(len(r["per_image"]["psnr"]) == images for r in rows(folder))
        if folder.parent.name == "clients":  # the app's LocalDpMod, read inside LeakAuditMod, is the defense
            assert described["defense"]["name"] == "flower_local_dp"
        if folder.name != "aggregate":
            assert described["sampled"]["1"].startswith(
                "it trained on 96 images, more than max_images=64: attacked on a seeded sample, 2 of its 3 "
                "minibatches (64 images)")
        assert (folder / "report.html").is_file()


@pytest.mark.heavy  # Flower's simulation with SecAgg+'s four stages a round
def test_secaggplus_mod_is_read_as_secure_aggregation_in_flowers_simulation(tmp_path, monkeypatch):
    """SecAgg+ as Flower's secure-aggregation example runs it (SecAggPlusWorkflow on the server, secaggplus_mod on
    each client) with LeakAuditMod around the mod: not refused; the stages that train nothing pass through, the
    round is audited once, and the threat box says the server sees only the sum of the 3 sampled clients."""
    import flower_training
    from digits_client import build_model
    from flwr.app import Context
    from flwr.client import ClientApp
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters
    from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.simulation import run_simulation

    from leakaudit.flower import LeakAuditMod

    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # Flower's Ray backend rewrites it
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    data = load_data()
    audit = LeakAuditMod(build_model, mods=[secaggplus_mod], out=tmp_path / "clients", mean=data.mean, std=data.std,
                         attacks=[{"name": "inverting_gradients", "params": {"iterations": 5}}])

    def client_fn(context: Context):
        own = slice(int(context.node_config["partition-id"]) * 2, int(context.node_config["partition-id"]) * 2 + 2)
        return flower_training.DigitsClient(build_model(), DataLoader(TensorDataset(*normalised(data)[own]),
                                                                      batch_size=2)).to_client()

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_fit=1.0, min_fit_clients=3, min_available_clients=3, fraction_evaluate=0.0,
                          initial_parameters=ndarrays_to_parameters(flower_training.get_weights(build_model())))
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
        DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2))(grid, legacy)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_simulation(server_app=server, client_app=ClientApp(client_fn=client_fn, mods=[audit]), num_supernodes=3,
                       backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    for name in ("0", "1", "2"):
        folder = tmp_path / "clients" / f"client-{name}"
        described = json.loads((folder / "monitor.json").read_text())
        assert described["fits"] == 1 and described["steps"] == [1] and len(rows(folder)) == 1  # undefended: as it left
        assert described["secure_aggregation"].startswith(
            "SecAgg+ (client mods): the server sees only the sum of the 3 sampled clients' masked updates")
        page = leakaudit.report_folder(folder) and (folder / "report.html").read_text()
        assert "Secure aggregation" in page


@pytest.mark.heavy  # two rounds of Flower's simulation, two clients audited from the server
def test_flower_simulation_with_a_dp_strategys_accountant_shows_both_epsilons_and_flags_its_population(
        tmp_path, monkeypatch):
    """DifferentialPrivacyServerSideFixedClipping with Flower's own RdpAccountant, told of a population of 50
    while the federation has 2 nodes, wrapped by LeakAuditStrategy in Flower's simulation: each client's report
    holds the accountant's claimed epsilon beside leakaudit's, the population flagged, epsilon over 2 rounds."""
    pytest.importorskip("dp_accounting")  # Flower's RdpAccountant: pip install 'flwr[dp]'
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod, ServerApp
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.simulation import run_simulation

    from leakaudit.flower import LeakAuditStrategy
    from leakaudit.plugins.defense import PrivacyProfile

    _flower_app(monkeypatch, tmp_path, images=40)
    import client_app
    from task import Net, load_data

    clients = ClientApp()
    clients.train()(client_app.train)  # the quickstart's own training, without the client-side audit
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        accountant = RdpAccountant(PrivacyConfig(target_delta=1e-5, population_size=50, sampling_method=SamplingMethod(
            "no-amplification"), neighboring_relation=NeighboringRelation("add-or-remove-one")))
        dp = DifferentialPrivacyServerSideFixedClipping(
            FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2),
            noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=2, accountant=accountant)
        strategy = LeakAuditStrategy(dp, Net(), lambda name: load_data(int(name), 2)[0], aggregate=False,
                                     out=tmp_path / "server", mean=0.5, std=0.5,
                                     attacks=[{"name": "inverting_gradients", "params": {"iterations": 5}}])
        strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                       train_config=ConfigRecord({"lr": 0.01}), num_rounds=2)
        strategy.report()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_simulation(server_app=server, client_app=clients, num_supernodes=2,
                       backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    own = PrivacyProfile(mu=1.0).epsilon(1e-5, 2)
    for name in ("0", "1"):
        summary = json.loads((tmp_path / "server" / f"client-{name}" / "summary.json").read_text())
        noisy = next(w for w in summary["worst_case"] if w["defense"] == "flower_fixed_clipping")
        claim, *flagged = noisy["privacy"]["claimed"]
        assert claim.startswith("Flower's accountant (rdp, no-amplification, population_size 50) claims epsilon 7.077 "
                                f"at delta 1e-05 over 2 releases; leakaudit's own accounting of the same releases: "
                                f"epsilon {own:.4g}")
        assert flagged == ["MISMATCH: the accountant's population_size 50 is not the 2 nodes the strategy samples "
                           "from: an epsilon amplified by sampling would be wrong"]
        assert noisy["epsilon"] == pytest.approx(own, rel=1e-9) and f"{own:.3g} over 2 rounds" in noisy["privacy"][
            "mechanism"]
