"""Auditing users' own training code: the Python API, a captured step function, factories in YAML."""
from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch import nn

from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.cli import main
from leakaudit.evaluator.live.api import audit_batch
from leakaudit.plugins.protocol import captured_update, fedsgd_update

from conftest import ROOT, small_audit

EXAMPLE = ROOT / "examples" / "own_training"
sys.path.insert(0, str(EXAMPLE))
import digits_client  # noqa: E402  (the example, imported as its audit file imports it)

IG = [{"name": "inverting_gradients", "params": {"iterations": 200}}]


def _digit(index: int = 0):
    data = digits_client.load_data()
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    x = data.test_x[index:index + 1]
    return (x - mean) / std, data.test_y[index:index + 1], data


def test_captured_sgd_step_is_the_gradient_and_leaves_the_model_as_it_was():
    model = digits_client.build_model()
    x, y, _ = _digit()
    before = [p.detach().clone() for p in model.parameters()]
    update = captured_update(model, digits_client.train_step, x, y, digits_client.LR)
    expected = fedsgd_update(model, F.cross_entropy, x, y)
    assert all(torch.allclose(u, g, atol=1e-5) for u, g in zip(update, expected))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_audit_batch_rebuilds_the_undefended_image_and_not_a_heavily_noised_one():
    x, y, data = _digit()
    model = digits_client.build_model()
    results = audit_batch(model, F.cross_entropy, x, y, defense={"name": "gaussian", "sweep": {"sigma": [1e-4, 1.0]}},
                          attacks=IG, mean=data.mean, std=data.std)
    psnr = {r.setting: r.metrics["psnr"] for r in results}
    assert psnr["gaussian(sigma=0.0001)"] > 22.0
    assert psnr["gaussian(sigma=1.0)"] < 10.0
    assert results[0].reconstruction.shape == x.shape and 0 <= results[0].reconstruction.min()


def test_audit_batch_takes_an_opacus_wrapped_model_as_it_is():
    x, y, data = _digit(1)
    plain = audit_batch(digits_client.build_model(), F.cross_entropy, x, y, attacks=IG[:1], mean=data.mean, std=data.std)
    wrapped = audit_batch(GradSampleModule(digits_client.build_model()), F.cross_entropy, x, y, attacks=IG[:1],
                          mean=data.mean, std=data.std)
    assert wrapped[0].metrics["psnr"] == pytest.approx(plain[0].metrics["psnr"], rel=1e-6)


@pytest.mark.parametrize("kwargs, expected", [
    ({"defense": "gausian"}, "audit_batch: defense.name: 'gausian' is not a registered defense (did you mean 'gaussian'?); choices:"),
    ({"lr": 0.1}, "audit_batch: lr: only applies with step_fn"),
    ({"step_fn": digits_client.train_step}, "audit_batch: lr: None; with step_fn give the SGD step size"),
    ({"step_fn": digits_client.train_step, "lr": 0.05, "defense": "dpsgd"}, "cannot wrap your own step"),
    ({"attacks": [{"name": "bayes", "tune": {"budget": 2, "space": {"lr": [0.1, 0.01]}}}]},
     "audit_batch: attacks: bayes: tune needs the attacker's own images"),
    ({"attacks": ["analytic"]}, "audit_batch: attacks: analytic: analytic: the model must start with a fully connected"),
    ({"attacks": [{"name": "inverting_gradients", "checkpoints": [0]}]},
     "audit_batch: attacks[0].checkpoints: audit_batch attacks the step you pass; leave checkpoints out"),
])
def test_audit_batch_refuses_bad_calls_before_any_work(kwargs, expected):
    x, y, _ = _digit()
    with pytest.raises(ConfigError, match=None) as info:
        audit_batch(digits_client.build_model(), F.cross_entropy, x, y, **kwargs)
    assert any(line.startswith(expected) or expected in line for line in info.value.lines), info.value.lines


def test_audit_batch_refuses_a_defense_that_would_change_the_live_model():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 14 * 14, 10))
    x, y, data = _digit()
    with pytest.raises(ConfigError) as info:
        audit_batch(model, F.cross_entropy, x, y, defense="dpsgd", mean=data.mean, std=data.std)
    assert "audit_batch: defense: dpsgd: changes the architecture" in info.value.lines[0]
    assert "BatchNorm" in info.value.lines[0]


@pytest.mark.heavy
def test_example_is_audited_from_yaml_and_from_the_api_with_the_same_result(tmp_path, capsys):
    audit = tmp_path / "audit.yaml"
    shutil.copy(EXAMPLE / "audit.yaml", audit)
    shutil.copy(EXAMPLE / "digits_client.py", tmp_path / "digits_client.py")  # imported from beside the audit file
    # two workers: each target is its own cell, solved alone as audit_batch solves its one batch
    assert main(["run", str(audit), "--out", str(tmp_path / "out"), "--no-progress", "--workers", "2"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    data = digits_client.load_data()
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    for row in rows:
        ids = torch.tensor(row["images"])
        inputs, labels = (data.test_x[ids] - mean) / std, data.test_y[ids]
        setting = {"name": row["defense"], "params": row["params"]}
        (api,) = audit_batch(digits_client.build_model(), F.cross_entropy, inputs, labels, defense=setting,
                             attacks=digits_client.ATTACKS, step_fn=digits_client.train_step, lr=digits_client.LR,
                             mean=data.mean, std=data.std, seed=0, step=row["checkpoint"],
                             batch_index=row["target"])
        assert api.setting == row["setting"]
        for metric in ("psnr", "ssim", "label_accuracy"):
            assert api.metrics[metric] == pytest.approx(row[metric], rel=1e-4, abs=1e-4), (row["setting"], metric)
    by_setting = {r["setting"]: r["psnr"] for r in rows}
    assert by_setting["none"] > 22.0 > 10.0 > by_setting["gaussian(sigma=1.0)"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["utility"]["none"]["accuracy"] > 0.4  # the user's own step trained the model


@pytest.mark.slow
def test_example_script_audits_itself_while_it_trains(capsys):
    digits_client.main(rounds=1, audit_every=1)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["round 0", "round 1"]
    assert all("inverting_gradients rebuilds the client's image at" in line for line in lines)


@pytest.mark.parametrize("change, expected", [
    ({"data": {"dataset": "digits", "factory": "digits_client:load_data"}},
     "data: give exactly one of dataset or factory (both given)"),
    ({"data": {"factory": "no_such_module:load"}}, "data.factory: cannot import module 'no_such_module'"),
    ({"model": {"factory": "digits_client:no_such"}}, "model.factory: module 'digits_client' has no attribute 'no_such'"),
    ({"model": {"checkpoints": [0]}}, "model: give exactly one of name or factory"),
    ({"protocol": {"name": "step", "function": "digits_client:train_step"}}, "protocol.lr: required for protocol step"),
    ({"protocol": {"name": "step", "function": "digits_client:train_step", "lr": 0.1, "local_lr": 0.1}},
     "protocol.local_lr: only applies to protocol fedavg"),
    ({"protocol": {"name": "fedsgd", "lr": 0.1}}, "protocol.lr: only applies to protocol step"),
    ({"protocol": {"name": "sgd"}}, "protocol.name: 'sgd'"),
])
def test_own_code_yaml_errors_name_the_key(change, expected, write_audit, capsys):
    assert main(["validate", "--import", str(write_audit(small_audit(**change)))]) == 2
    err = capsys.readouterr().err
    assert expected in err, err


def test_a_data_factory_that_returns_the_wrong_thing_is_named(write_audit, tmp_path, capsys):
    (tmp_path / "bad_data.py").write_text("def load(image_size):\n    return [1, 2, 3]\n")
    path = write_audit(small_audit(data={"factory": "bad_data:load", "image_size": 16, "targets": 2}))
    assert main(["validate", str(path)]) == 0  # validate does not call the user's code
    assert "user code found on the import path, not imported" in capsys.readouterr().out
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()  # refused before any work
    err = capsys.readouterr().err
    assert "data.factory: bad_data:load returned list; return leakaudit.ImageData(" in err
