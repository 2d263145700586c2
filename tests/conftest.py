"""Shared fixtures: small audit files, the registry and a seeded torch."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
LEAKAUDIT = [sys.executable, "-m", "leakaudit"]


#: The tiers beyond the fast one, each with the option that runs it: ``python -m pytest`` alone is the fast tier
#: (unit tests of every room, about 2 minutes on 2 cores); CI adds the end-to-end audits (``--runslow``);
#: ``--runheavy`` adds the shipped audits at their heavier settings, browsers and clusters.
TIERS = {"slow": "--runslow", "heavy": "--runheavy"}


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the end-to-end checks marked slow (what CI runs)")
    parser.addoption("--runheavy", action="store_true", default=False,
                     help="also run the checks marked heavy (shipped audits at their heavier settings, browsers, "
                          "clusters); implies --runslow")


def pytest_collection_modifyitems(config, items):
    """Checks of a tier are skipped unless its option is given (or -m names it), as in pytest's own docs."""
    heavy = config.getoption("--runheavy")
    runs = {"slow": heavy or config.getoption("--runslow"), "heavy": heavy}
    for tier, option in TIERS.items():
        if runs[tier] or tier in (config.getoption("markexpr") or ""):
            continue
        skip = pytest.mark.skip(reason=f"{tier}: run with {option}")
        for item in items:
            if tier in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    """Analyses and measured costs are cached in a folder of the test session, not the user's cache (subprocesses
    inherit it)."""
    import os

    os.environ["LEAKAUDIT_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # the Ray and Flower tests: no network beyond loopback
    os.environ["LEAKAUDIT_ESTIMATE"] = "0"  # no time estimate before each small audit (tests/test_budget.py's turn it on)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def registry():
    from leakaudit.plugins.manager import load_registry

    return load_registry()


def small_audit(**overrides) -> dict:
    """A tiny but real audit: digits, lenet_zhu, few iterations."""
    audit = {
        "name": "small",
        "seed": 0,
        "device": "cpu",
        "workers": 1,
        "data": {"dataset": "digits", "image_size": 16, "targets": 2, "batch_size": 1},
        "model": {"name": "lenet_zhu", "checkpoints": [0]},
        "defenses": [{"name": "none"}, {"name": "gaussian", "params": {"sigma": 0.1}}],
        "attacks": [{"name": "inverting_gradients", "params": {"iterations": 20}}],
        "utility": {"train_steps": 5, "batch_size": 8},
        "metrics": ["psnr", "ssim", "mse", "label_accuracy"],
    }
    for key, value in overrides.items():
        audit[key] = value
    return audit


@pytest.fixture
def write_audit(tmp_path):
    def write(audit: dict, name: str = "audit.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(audit, sort_keys=False))
        return path
    return write


def flower_train_round(monkeypatch, state: dict, server_round: int) -> tuple:
    """A Message-API training message carrying ``state`` for round ``server_round``, and the context a SuperNode
    gives partition 0 of 2 (Flower's task identity set as a SuperNode sets it before it runs the app)."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    for field in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, field, 7, raising=False)
    message = Message(content=RecordDict({"arrays": ArrayRecord(state),
                                          "config": ConfigRecord({"lr": 0.01, "server-round": server_round})}),
                      dst_node_id=7, message_type=MessageType.TRAIN)
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                      run_config={})
    return message, context
