"""`leakaudit schema`: the JSON Schema accepts every shipped audit file and rejects what validation rejects."""
from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import jsonschema
import pytest

from leakaudit.evaluator.config import parse_yaml, read_yaml
from leakaudit.evaluator.schema import audit_schema
from leakaudit.evaluator.starter import starter_audit
from leakaudit.plugins.manager import load_registry

from conftest import ROOT, small_audit

SHIPPED = sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("examples/**/*.yaml")])


@pytest.fixture(scope="module")
def validator():
    schema = audit_schema(load_registry())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _errors(validator, audit) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(audit)]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_audit_validates(validator, path):
    _, audit = read_yaml(path)  # the project's loader: 1e-5 is a number, as in YAML 1.2
    assert _errors(validator, audit) == []


def test_starter_audits_validate(validator, registry):
    for name in registry.names("defense"):
        audit = parse_yaml(Path("starter.yaml"), starter_audit(registry, [name]))
        assert _errors(validator, audit) == [], name


def _with(path: str, value):
    audit = small_audit()
    node = audit
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[keys[-1]] = value
    return audit


@pytest.mark.parametrize("audit, where", [
    (_with("defenses", [{"name": "gausian"}]), "defenses.0.name"),
    (_with("defenses", [{"name": "gaussian", "params": {"sigma": -1}}]), "defenses.0.params.sigma"),
    (_with("defenses", [{"name": "gaussian", "sweep": {"sigma": [0.1, 0]}}]), "defenses.0.sweep.sigma.1"),
    (_with("defenses", [{"chain": [{"name": "clip", "params": {"max_nrm": 1}}]}]), "defenses.0.chain.0.params"),
    (_with("attacks", [{"name": "inverting_gradients", "params": {"iterations": "many"}}]),
     "attacks.0.params.iterations"),
    (_with("attacks", [{"name": "bayes", "role": "strong"}]), "attacks.0.role"),
    (_with("seed", "x"), "seed"),
    (_with("data.colour", True), "data"),
    (_with("model.checkpoints", [-1]), "model.checkpoints.0"),
    (_with("metrics", ["psnr", "sharpness"]), "metrics.1"),
    (_with("protocol", {"name": "fedsgd", "local_lr": 0.1}), "protocol"),
    (_with("executor", {"name": "ray", "num_cpus": 0}), "executor"),
    ({**small_audit(), "colour": True}, ""),
])
def test_rejects(validator, audit, where):
    errors = _errors(validator, audit)
    assert errors and any(e.startswith(f"{where}: ") for e in errors), errors


@pytest.mark.parametrize("path, value", [
    ("defenses", [{"chain": [{"name": "clip", "params": {"max_norm": 1.0}},
                             {"name": "gaussian", "sweep": {"sigma": [0.01, 0.1]}}], "label": "clip+noise"}]),
    ("protocol", {"name": "fedavg", "local_epochs": 2, "local_lr": 0.01}),
    ("protocol", "fedavg"),
    ("executor", "ray"),
    ("executor", {"name": "ray", "num_cpus": 2}),
    ("max_problems", 8),
    ("leakage_metric", "ssim"),
])
def test_accepts(validator, path, value):
    assert _errors(validator, _with(path, copy.deepcopy(value))) == []


def test_a_dropin_plugin_is_in_the_schema(tmp_path):
    (tmp_path / "mine.py").write_text(textwrap.dedent("""
        import leakaudit

        class Mine(leakaudit.Defense):
            '''My defense.'''
            name = "mine"
            params = {"scale": leakaudit.Param(type=float, min=0.0, exclusive_min=True, help="how much")}

        @leakaudit.hookimpl
        def register_defenses():
            return [Mine]
    """))
    validator = jsonschema.Draft7Validator(audit_schema(load_registry([tmp_path])))
    assert _errors(validator, _with("defenses", [{"name": "mine", "params": {"scale": 0.5}}])) == []
    assert [e.split(": ")[0] for e in _errors(validator, _with("defenses", [{"name": "mine", "params": {"scale": 0}}]))
            ] == ["defenses.0.params.scale"]
