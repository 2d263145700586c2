"""Secure aggregation (Bonawitz et al. 2017) as FedAvg's ``clients``: the server sees only the mean update."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.run.runner import run_audit
from leakaudit.plugins.protocol import FedAvg, parameter_names, trainable
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


def test_the_mean_of_four_clients_leaks_less_than_one_client(write_audit, tmp_path):
    """Inverting Gradients on 4 digits at 16 px: one image per update (23.2 dB measured) against the mean of
    4 clients' updates of one image each (16.2 dB): the aggregate hides each image behind the others."""
    psnr = {}
    for clients in (1, 4):
        audit = small_audit(data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": clients},
                            defenses=[{"name": "none"}], utility={"train_steps": 0}, metrics=["psnr", "label_accuracy"],
                            protocol={"name": "fedavg", "local_lr": 0.1, "clients": clients},
                            attacks=[{"name": "inverting_gradients", "params": {"iterations": 300}}])
        summary = run_audit(load_audit(write_audit(audit, f"c{clients}.yaml")), tmp_path / f"c{clients}", progress=False)
        psnr[clients] = summary.cells[0].mean("psnr")
    assert psnr[1] > 20 and psnr[4] < psnr[1] - 3


def test_the_threat_box_says_the_server_sees_only_the_mean(write_audit):
    from leakaudit.evaluator.results.report import threat_model

    audit = small_audit(data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 4},
                        protocol={"name": "fedavg", "local_lr": 0.1, "clients": 4})
    protocol = dict(threat_model(load_audit(write_audit(audit))))["Protocol"]
    assert protocol == ("fedavg (local_epochs=1, local_batch_size=None, local_lr=0.1); under secure aggregation the "
                        "server sees only the mean of 4 clients' updates, each of 1 private image(s)")
