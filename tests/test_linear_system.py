"""Chen & Campbell's (2022) layer-wise linear systems: rank deficiencies and the security metric (Table 1)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from leakaudit.attacks.linear_system import conv_systems, security_metric
from leakaudit.evaluator.cli import main
from leakaudit.evaluator.zoo.models import LINEAR_SYSTEM_VARIANTS, linear_system_cnn

from conftest import small_audit

#: Chen & Campbell 2022, Table 1: rank deficiency per convolutional layer and the metric, on 32x32x3 inputs.
TABLE_1 = {
    "cnn2_v1": ([0], 0), "cnn2_v2": ([-1470], -1470),
    "cnn3_v1": ([0, -4533], -2266), "cnn3_v2": ([-1470, -1050], -1995),
    "cnn3_v3": ([0, 0], 0), "cnn3_v4": ([-2146, 0], -2146),
    "cnn4_v1": ([0, -3965, -386], -2772), "cnn4_v2": ([0, -9316, 0], -6211),
}
HEAVY = {"cnn3_v3", "cnn4_v2"}  # systems of 7542 x 5400 and 13744 x 3072: about 30 s each


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY else n for n in TABLE_1])
def test_rank_deficiencies_and_metric_are_chen_campbell_2022_table_1(name):
    torch.set_num_threads(2)  # dense float64 linear algebra: BLAS uses both cores (attacks use one per process)
    model = linear_system_cnn(3, 10, 32, LINEAR_SYSTEM_VARIANTS[name]).double()
    systems = conv_systems(model, F.cross_entropy, torch.rand(1, 3, 32, 32, dtype=torch.float64), torch.tensor([4]))
    deficiencies = [s.rank_deficiency() for s in systems]
    expected, metric = TABLE_1[name]
    assert deficiencies == expected
    assert round(security_metric(deficiencies)) == metric


def test_the_metric_weights_early_layers_most():
    assert security_metric([-10, 0, 0]) == -10.0
    assert security_metric([0, 0, -10]) == pytest.approx(-10 / 3)
    assert security_metric([]) == 0.0


def test_the_system_holds_the_true_input():
    model = linear_system_cnn(3, 10, 16, LINEAR_SYSTEM_VARIANTS["cnn3_v1"]).double()
    x = torch.rand(1, 3, 16, 16, dtype=torch.float64)
    first, second = conv_systems(model, F.cross_entropy, x, torch.tensor([2]))
    torch.testing.assert_close(first.matrix @ x.reshape(-1), first.rhs)
    hidden = torch.tanh(model[0](x))
    torch.testing.assert_close(second.matrix @ hidden.reshape(-1), second.rhs)


def test_analyse_prints_the_layers_and_the_metric(write_audit, capsys):
    path = write_audit(small_audit(data={"dataset": "cifar10_samples", "image_size": 32, "targets": 1},
                                   model={"name": "cnn3_v2"}))
    assert main(["analyse", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [layer["rank_deficiency"] for layer in result["layers"]] == [-1470, -1050]
    assert result["metric"] == -1995.0
    assert main(["analyse", str(path)]) == 0
    assert "security metric (Chen & Campbell 2022, Def. 3.3): -1995.0" in capsys.readouterr().out


def test_analyse_reads_the_cache_the_first_analysis_wrote(write_audit, capsys, monkeypatch, tmp_path):
    from leakaudit.evaluator.run import analysis

    monkeypatch.setenv("LEAKAUDIT_CACHE", str(tmp_path / "cache"))
    path = write_audit(small_audit(data={"dataset": "cifar10_samples", "image_size": 32, "targets": 1},
                                   model={"name": "cnn3_v2"}))
    assert main(["analyse", str(path), "--json"]) == 0
    first = capsys.readouterr().out
    assert len(list((tmp_path / "cache" / "analysis").glob("*.json"))) == 1

    def no_rank_work(*_args):
        raise AssertionError("analysed again despite the cache")

    monkeypatch.setattr(analysis, "analyse", no_rank_work)
    assert main(["analyse", str(path), "--json"]) == 0
    assert capsys.readouterr().out == first


def test_analyse_says_which_layer_it_cannot_cover(write_audit, capsys):
    path = write_audit(small_audit(model={"name": "convbig"}))
    assert main(["analyse", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"leakaudit: error: {path}: model: convbig: layer pool1 (AvgPool2d) is not a Conv2d, Linear, Flatten or "
        "one of Tanh, Sigmoid, LeakyReLU, ReLU, Identity")


@pytest.mark.slow
def test_analyse_refuses_a_system_too_large_to_build(write_audit, capsys):
    path = write_audit(small_audit(data={"dataset": "digits", "image_size": 256, "targets": 1}))
    assert main(["analyse", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"leakaudit: error: {path}: model: lenet_zhu: layer 0's system (") and "GiB as a dense" in err


@pytest.mark.parametrize("attack, key, shown", [
    ("rgap", "auto", True), ("hybrid", "auto", True), ("inverting_gradients", "auto", False),
    ("rgap", False, False), ("inverting_gradients", True, True)])
def test_the_report_shows_the_analysis_where_an_attack_solves_the_systems_or_the_audit_asks(
        write_audit, attack, key, shown):
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.runner import shows_architecture

    audit = small_audit(attacks=[{"name": attack}], architecture=key, defenses=[{"name": "none"}])
    assert shows_architecture(load_audit(write_audit(audit))) is shown
