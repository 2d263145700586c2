"""Secure aggregation (Bonawitz et al. 2017) as FedAvg's ``clients``: the server sees only the mean update."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.run.runner import run_audit
from leakaudit.evaluator.authoring.cases import check_threat, seeded_generator
from leakaudit.plugins.attack import Problem, own_coordinates_problem, solve
from leakaudit.plugins.defense import ALONE
from leakaudit.plugins.protocol import CONTRIBUTORS, ClientStep, FedAvg, parameter_names, trainable
from leakaudit.testing import tiny_case

from conftest import small_audit


def test_the_server_sees_the_mean_of_the_clients_updates():
    model, x, y = tiny_case(images=4)
    two = FedAvg(local_epochs=2, local_lr=0.1, clients=2)
    one = FedAvg(local_epochs=2, local_lr=0.1)
    halves = [one.client_update(model, F.cross_entropy, x[i:i + 2], y[i:i + 2]) for i in (0, 2)]
    expected = [(a + b) / 2 for a, b in zip(*halves)]
    got = two.client_update(model, F.cross_entropy, x, y)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    params = dict(zip(parameter_names(model), (p.detach() for p in trainable(model))))
    functional = two.functional_update(model, params, {}, F.cross_entropy, x, y)  # what vmapped attacks unroll
    for name, e in zip(parameter_names(model), expected):
        torch.testing.assert_close(functional[name], e)
    assert two.local_steps(4) == 2 and two.gradient_scale(4) == pytest.approx(1 / (0.1 * 2))


def test_clients_must_share_the_update_images_equally(write_audit):
    audit = small_audit(data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 4},
                        protocol={"name": "fedavg", "clients": 3})
    with pytest.raises(ConfigError, match="protocol.clients: 3 clients cannot share data.batch_size 4 images"):
        load_audit(write_audit(audit))


# slow: the same finding from the server's view is tests/test_strategy.py's, run by default
@pytest.mark.heavy
def test_the_mean_of_four_clients_leaks_less_than_one_client_in_one_audit(write_audit, tmp_path):
    """Inverting Gradients on 4 digits at 16 px, one image per client, in one audit whose entries name 1 and 4
    clients (23.4 against 17.3 dB measured): the aggregate hides each image behind the others, and the report
    sets each defense against the number of clients, each verdict calibrated by the reference of its own."""
    audit = small_audit(data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 1},
                        defenses=[{"name": "gaussian", "params": {"sigma": 0.01}, "clients": [1, 4]}],
                        utility={"train_steps": 0}, metrics=["psnr", "label_accuracy"],
                        protocol={"name": "fedavg", "local_lr": 0.1},
                        attacks=[{"name": "inverting_gradients", "params": {"iterations": 300}}])
    loaded = load_audit(write_audit(audit))
    assert [(s.key, s.added, loaded.batch_size_of(s)) for s in loaded.settings] == [
        ("gaussian(sigma=0.01)[1 client]", False, 1), ("gaussian(sigma=0.01)[4 clients]", False, 4),
        ("none[1 client]", True, 1), ("none[4 clients]", True, 4)]
    assert loaded.reference_of(loaded.settings[1]).key == "none[4 clients]"
    assert loaded.protocol_of(loaded.settings[1]).clients == 4 and loaded.num_batches_of(loaded.settings[1]) == 1
    summary = run_audit(loaded, tmp_path / "out", progress=False)
    psnr = {w.setting: w.mean("psnr") for w in summary.worst_case}
    assert psnr["none[1 client]"] > 20 and psnr["none[4 clients]"] < psnr["none[1 client]"] - 3
    assert psnr["gaussian(sigma=0.01)[4 clients]"] < psnr["gaussian(sigma=0.01)[1 client]"] - 3
    assert {w.setting: w.clients for w in summary.worst_case}["none[4 clients]"] == 4
    page = (tmp_path / "out" / "report.html").read_text()
    assert "Leakage against the number of clients" in page and "4 clients<br><small>4 images" in page


@pytest.mark.parametrize("protocol, clients, message", [
    ("fedsgd", [1, 4], r"defenses\[0\].clients: secure aggregation needs protocol fedavg"),
    ({"name": "fedavg"}, [0, 2], r"defenses\[0\].clients: expected a number of clients of at least 1"),
    ({"name": "fedavg"}, [2, 2], r"defenses\[0\].clients: \[2, 2\] names a number of clients twice"),
    ({"name": "fedavg"}, [3], r"defenses\[0\].clients: 3 clients of 1 image\(s\) each .* make updates of 3 images, "
                              "which data.targets 4 is not a multiple of"),
])
def test_bad_clients_of_a_defense_entry_are_one_line_errors(write_audit, protocol, clients, message):
    audit = small_audit(data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 1},
                        defenses=[{"name": "none", "clients": clients}], protocol=protocol)
    with pytest.raises(ConfigError, match=message) as caught:
        load_audit(write_audit(audit))
    assert len(caught.value.lines) == 1


def test_the_threat_box_says_the_server_sees_only_the_mean(write_audit):
    from leakaudit.evaluator.results.report import threat_model

    audit = small_audit(data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 4},
                        protocol={"name": "fedavg", "local_lr": 0.1, "clients": 4})
    protocol = dict(threat_model(load_audit(write_audit(audit))))["Protocol"]
    assert protocol == ("fedavg (local_epochs=1, local_batch_size=None, local_lr=0.1); under secure aggregation the "
                        "server sees only the mean of 4 clients' updates, each of 1 private image(s)")


def _sparse_case(secure_aggregation: str):
    """16 clients of one 8 px digit each on the zoo's untrained mlp, every client keeping its top 5% under secure
    aggregation."""
    from leakaudit.defenses.pruning import TopK
    from leakaudit.evaluator.zoo.datasets import load_digits
    from leakaudit.evaluator.zoo.models import mlp

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = mlp(1, 10, 8)
    data = load_digits(8)
    x, y = data.test_x[:16].clone(), data.test_y[:16].clone()
    protocol = FedAvg(local_lr=0.1, clients=16, secure_aggregation=secure_aggregation)
    defense = TopK(fraction=0.05)
    observed = defense.share(ClientStep(model, F.cross_entropy, x, y, seeded_generator(x.device, 0), protocol))
    own = [defense.transform(u) for u in protocol.client_updates(model, F.cross_entropy, x, y)]
    return model, x, y, protocol, defense, observed, own


def test_a_coordinate_one_client_alone_sent_is_that_clients_value_under_per_element_aggregation():
    """Each client sparsifies its own update; per-element secure aggregation divides each coordinate by the count of
    clients that sent it, so where one did the aggregate is its value exactly, not a sixteenth of it."""
    *_, observed, own = _sparse_case("per_element")
    counts = observed.metadata[CONTRIBUTORS]
    for t, n, parts in zip(observed.tensors, counts, zip(*own)):
        torch.testing.assert_close(n, torch.stack([p != 0 for p in parts]).sum(0))
        torch.testing.assert_close(t, torch.stack(parts).sum(0) / n.clamp_min(1))
    alone = observed.metadata[ALONE]
    assert sum(int(m.sum()) for m in alone) > 0
    for t, m, mine in zip(observed.tensors, alone, own[0]):
        assert torch.equal(t[m], mine[m])
    *_, mean, _ = _sparse_case("sum")  # Bonawitz et al.'s mean: no counts, every coordinate a sixteenth
    assert ALONE not in mean.metadata and CONTRIBUTORS not in mean.metadata
    for t, parts in zip(mean.tensors, zip(*own)):
        torch.testing.assert_close(t, torch.stack(parts).mean(0))


def test_top_k_under_16_client_secure_aggregation_leaks_through_single_contributor_coordinates():
    """The first client's digit rebuilt from the coordinates it alone sent (per-element aggregation: each is its
    own value) leaks; the same attack on the plain mean's values there (a sixteenth of each) does not."""
    from leakaudit.attacks.bayes import BayesOptimal
    from leakaudit.evaluator.zoo.metrics import psnr

    model, x, y, protocol, defense, observed, _ = _sparse_case("per_element")
    threat = check_threat(model, x, y, defense, protocol, known_labels=True)
    problem = own_coordinates_problem(Problem(observed, threat, seeded_generator(x.device, 1),
                                              BayesOptimal(iterations=100)))
    assert problem is not None and problem.threat.batch_size == 1 and problem.threat.protocol.clients == 1
    mean = dataclasses.replace(problem, observed=dataclasses.replace(problem.observed,
                                                                     tensors=_sparse_case("sum")[-2].tensors))
    leaked, hidden = (float(psnr(r.images, x[:1]).mean()) for r in solve([problem, mean]))
    assert leaked > 17 and hidden < 12, (leaked, hidden)
    plain = Problem(_sparse_case("sum")[-2], threat, seeded_generator(x.device, 1), BayesOptimal(iterations=1))
    assert own_coordinates_problem(plain) is None  # the plain mean reveals no counts: nothing read as one client's


SPARSE = Path(__file__).resolve().parent.parent / "configs" / "secure_aggregation_sparse.yaml"


def _sparse_audit(tmp_path, secure_aggregation: str, **data):
    """The shipped sparse audit, read with ``secure_aggregation`` (and any ``data`` keys changed)."""
    raw = yaml.safe_load(SPARSE.read_text())
    raw["protocol"]["secure_aggregation"] = secure_aggregation
    raw["data"].update(data)
    path = tmp_path / f"{secure_aggregation}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_audit(path)


def _read(audit):
    """The worker's reading of the first target batch of the audit's topk setting, with the clients' own top-k
    updates as computed apart from the engine."""
    from leakaudit.attacks.bayes import BayesOptimal
    from leakaudit.evaluator.run.scenario import Scenario, loss_fn
    from leakaudit.evaluator.run.worker import AuditWorker

    scenario = Scenario(audit)
    setting = next(s for s in audit.settings if not s.is_baseline(audit.registry))
    defense, worker = scenario.defense(setting), AuditWorker(scenario, folder=None)
    model = scenario.fresh_model(defense, setting)
    worker.provide_states(setting.key, lambda: {0: model.state_dict()})
    pixels, labels = scenario.target_batch(0, setting)
    read = worker.problems(setting, 0, [(pixels, labels, 0, BayesOptimal(iterations=1))], "")[0]
    protocol = scenario.protocol(setting)
    own = [defense.transform(u) for u in protocol.client_updates(model, loss_fn, scenario.normalise(pixels), labels)]
    return read, pixels, labels, own


def test_the_worker_attacks_client_ones_own_coordinates_under_per_element_aggregation(tmp_path):
    """The engine's problem under per-element secure aggregation: client 1's top-k update on the coordinates it
    alone sent, exactly, scored against its digit alone; under the plain mean (sum) the 16-digit aggregate."""
    read, pixels, labels, own = _read(_sparse_audit(tmp_path, "per_element", targets=16))
    problem = read.problem
    assert read.own_coordinates and read.own_coordinates > 100
    assert problem.threat.batch_size == 1 and problem.threat.protocol.clients == 1
    assert torch.equal(read.originals, pixels[:1]) and torch.equal(read.labels, labels[:1])
    alone = problem.observed.metadata[ALONE]
    assert sum(int(m.sum()) for m in alone) == read.own_coordinates
    for t, m, mine in zip(problem.observed.tensors, alone, own[0]):
        assert torch.equal(t[m], mine[m]) and not t[~m].any()  # its own values there, nothing elsewhere
    assert any(mine[m].abs().max() > 0 for m, mine in zip(alone, own[0]))
    mean, pixels, _, own = _read(_sparse_audit(tmp_path, "sum", targets=16))
    assert mean.own_coordinates is None and mean.problem.threat.batch_size == 16 and len(mean.originals) == 16
    for t, parts in zip(mean.problem.observed.tensors, zip(*own)):
        torch.testing.assert_close(t, torch.stack(parts).mean(0))


def test_the_verdict_says_how_the_updates_were_read():
    from leakaudit.evaluator.results.verdict import own_coordinates_words

    assert own_coordinates_words([393], "topk").startswith(
        "393 coordinates had one contributor: read as client 1's own topk update, its reconstruction scored "
        "against client 1's images alone")
    assert own_coordinates_words([0, 0], "topk") == (
        "no coordinate had one contributor in any of its 2 updates: the aggregate attacked as a whole, every "
        "client's images scored")
    assert "in 1 of its 2 updates 7 coordinates" in own_coordinates_words([7, 0], "topk")


def test_a_bad_secure_aggregation_is_one_line_naming_file_key_and_choices(tmp_path):
    raw = yaml.safe_load(SPARSE.read_text())
    raw["protocol"]["secure_aggregation"] = "elementwise"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as caught:
        load_audit(path)
    assert caught.value.lines == [f"{path}: protocol.secure_aggregation: 'elementwise' is not one of the choices; "
                                  "choices: sum, per_element"]


def test_a_run_folder_of_one_aggregation_is_not_resumed_with_the_other():
    from leakaudit.evaluator.results.rundir import same_audit

    text = SPARSE.read_text()
    assert same_audit(text, text) and not same_audit(text, text.replace("per_element", "sum"))


@pytest.mark.slow
def test_the_shipped_sparse_audit_leaks_client_ones_digits_per_element_and_less_under_the_mean(tmp_path):
    """configs/secure_aggregation_sparse.yaml as shipped (per_element): each update's coordinates that client 1
    alone sent are attacked as its own update and leak its digit, and the verdict says so; the same file read as
    the plain mean (sum) attacks the 16-digit aggregate and reads far less. A run cut short resumes to the same
    verdict (the rows read back keep how their updates were read)."""
    from leakaudit.evaluator.results.verdict import INDIVIDUALS, LEAKS

    audit = _sparse_audit(tmp_path, "per_element")
    out = tmp_path / "per_element"
    summary = run_audit(audit, out, progress=False)
    top = next(w for w in summary.worst_case if not w.baseline)
    assert (top.verdict, top.level) == (LEAKS, INDIVIDUALS), top.reason
    assert "coordinates had one contributor: read as client 1's own topk update" in top.reason
    cell = summary.cell(top.setting, "bayes", 0)
    assert cell.own_coordinates is not None and len(cell.own_coordinates) == 4 and min(cell.own_coordinates) > 100
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    own = [r for r in rows if r["setting"] == top.setting]
    assert all(len(r["images"]) == 1 and r["own_coordinates"] > 0 for r in own)
    mean = run_audit(_sparse_audit(tmp_path, "sum"), tmp_path / "sum", progress=False)
    hidden = next(w for w in mean.worst_case if not w.baseline)
    assert "coordinates had one contributor" not in hidden.reason
    assert mean.cell(hidden.setting, "bayes", 0).own_coordinates is None
    assert top.mean("psnr") > hidden.mean("psnr") + 3, (top.mean("psnr"), hidden.mean("psnr"))
    firsts = [json.loads(line)["per_image"]["psnr"][0] for line in (tmp_path / "sum" / "results.jsonl").read_text()
              .splitlines() if json.loads(line)["setting"] == hidden.setting]  # the same digits in the mean
    assert len(firsts) == 4 and top.mean("psnr") > sum(firsts) / 4 + 3, firsts
    kept = [line for line in (out / "results.jsonl").read_text().splitlines()
            if json.loads(line)["setting"] != top.setting or json.loads(line)["target"] < 2]
    (out / "results.jsonl").write_text("\n".join(kept) + "\n")  # as a run stopped after two of its updates
    resumed = run_audit(_sparse_audit(tmp_path, "per_element"), out, resume=True, progress=False)
    again = next(w for w in resumed.worst_case if not w.baseline)
    assert again.reason == top.reason and again.mean("psnr") == pytest.approx(top.mean("psnr"), abs=1e-3)
