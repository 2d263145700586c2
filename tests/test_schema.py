"""The audit file's JSON Schema: shipped audits validate, it judges as the loader does, drop-in plugins are in it."""
from __future__ import annotations

import copy
import importlib.util
import textwrap

import jsonschema
import pytest

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.schema import audit_schema
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.audit.yamlfile import read_yaml
from leakaudit.plugins.manager import load_registry

from conftest import ROOT, small_audit

SHIPPED = sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("examples/**/*.yaml")])
FACTORY = "def build(**kwargs):\n    raise AssertionError('only imported')\n"


@pytest.fixture(scope="module")
def validator(registry):
    schema = audit_schema(registry)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _paths(validator, audit: dict) -> list[tuple]:
    """Where each problem the schema finds sits in the file (key path; () for the top level)."""
    return [tuple(e.absolute_path) for e in validator.iter_errors(audit)]


def _changed(**changes) -> dict:
    """``small_audit()`` with ``a__b`` keys set (``__`` descends into mappings)."""
    audit = small_audit()
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = audit
        for key in path:
            node = node[key]
        node[last] = copy.deepcopy(value)
    return audit


def test_schema_is_draft_07_and_offline(registry):
    schema = audit_schema(registry)
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#" and "$id" not in schema
    assert schema["title"] and schema["description"]
    assert {"name", "data", "model", "defenses"} == set(schema["required"])  # attacks: auto when absent


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_audit_validates(validator, path):
    _, audit = read_yaml(path)  # the project's reader: 1e-5 is a number, as the loader sees it
    if not (isinstance(audit, dict) and "attacks" in audit):
        pytest.skip("not an audit file")
    assert _paths(validator, audit) == []


REJECTED = [
    ("misspelt defense", _changed(defenses=[{"name": "none"}, {"name": "gausian"}]), ("defenses", 1, "name")),
    ("negative sigma", _changed(defenses=[{"name": "gaussian", "params": {"sigma": -1}}]),
     ("defenses", 0, "params", "sigma")),
    ("required param missing", _changed(defenses=[{"name": "gaussian"}]), ("defenses", 0)),
    ("unknown top-level key", {**small_audit(), "colour": "red"}, ()),
    ("unknown data key", _changed(data__colour="red"), ("data",)),
    ("no checkpoints", _changed(model__checkpoints=[]), ("model", "checkpoints")),
    ("seed not an integer", _changed(seed="x"), ("seed",)),
    ("attack param of the wrong type",
     _changed(attacks=[{"name": "inverting_gradients", "params": {"iterations": "many"}}]),
     ("attacks", 0, "params", "iterations")),
    ("tuning a parameter the attack lacks",
     _changed(attacks=[{"name": "inverting_gradients", "tune": {"space": {"lrr": [0.1]}}}]),
     ("attacks", 0, "tune", "space")),
    ("protocol setting of another protocol", _changed(protocol={"name": "fedsgd", "local_lr": 0.1}), ("protocol",)),
    ("step protocol without its settings", _changed(protocol="step"), ("protocol",)),
    ("leakage metric not measured", _changed(leakage_metric="lpips"), ()),
    ("attacks as a word other than auto", _changed(attacks="all"), ("attacks",)),
    ("a bare name misspelt", _changed(attacks=["inverting_gradient"]), ("attacks", 0)),
    ("lpips on 16 px images", _changed(metrics=["psnr", "lpips"]), ("data", "image_size")),
]
ACCEPTED = [
    ("attacks left to auto", _changed(attacks="auto")),
    ("bare names", _changed(defenses=["none", {"name": "gaussian", "params": {"sigma": 0.1}}],
                            attacks=["inverting_gradients", "bayes"])),
    ("a chain", _changed(defenses=[{"chain": [{"name": "clip", "params": {"max_norm": 1.0}},
                                              {"name": "gaussian", "sweep": {"sigma": [0.01, 0.1]}}]}])),
    ("fedavg with local_epochs", _changed(protocol={"name": "fedavg", "local_epochs": 2})),
    ("executor by name", _changed(executor="ray")),
    ("executor mapping", _changed(executor={"name": "ray", "num_cpus": 2})),
    ("a required param swept", _changed(defenses=[{"name": "gaussian", "sweep": {"sigma": [0.1, 1.0]}}])),
    ("a factory as the model's name", _changed(model={"name": "schema_factory:build", "checkpoints": [0]})),
    ("null where the default is null", _changed(defenses=[{"name": "none", "chain": None, "model": None}],
                                                attacks=[{"name": "bayes", "tune": None, "role": None,
                                                          "defenses": None, "checkpoints": None}])),
    ("one value or a list of three", _changed(attacks=[{"name": "hybrid", "params": {"iterations": [9, 8, 7],
                                                                                      "tv": 0.01}}])),
]


@pytest.mark.parametrize("audit, where", [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_rejects_what_the_loader_rejects(validator, registry, write_audit, audit, where):
    assert where in _paths(validator, audit)
    with pytest.raises(ConfigError):
        load_audit(write_audit(audit), registry=registry)


@pytest.mark.parametrize("audit", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_accepts_what_the_loader_accepts(validator, registry, write_audit, audit):
    assert _paths(validator, audit) == []
    path = write_audit(audit)
    (path.parent / "schema_factory.py").write_text(FACTORY)
    if "ray" not in str(audit.get("executor")) or importlib.util.find_spec("ray"):  # the loader wants Ray installed
        load_audit(path, registry=registry)


def test_a_dropin_plugin_is_in_the_enums_with_its_range(tmp_path, registry):
    (tmp_path / "schema_mine.py").write_text(textwrap.dedent("""
        import leakaudit

        class Mine(leakaudit.Defense):
            '''My defense.'''
            name = "mine"
            params = {"scale": leakaudit.Param(type=float, min=0.0, exclusive_min=True)}

        @leakaudit.hookimpl
        def register_defenses():
            return [Mine]
    """))
    schema = audit_schema(load_registry([tmp_path]))
    enums = []
    _collect_enums(schema, enums)
    defense_enums = [e for e in enums if set(registry.names("defense")) <= set(e)]  # names, not a param's choices
    assert defense_enums and all("mine" in e for e in defense_enums)
    validator = jsonschema.Draft7Validator(schema)
    assert _paths(validator, _changed(defenses=[{"name": "mine", "params": {"scale": 0.5}}])) == []
    assert _paths(validator, _changed(defenses=[{"name": "mine", "params": {"scale": 0}}])) == [
        ("defenses", 0, "params", "scale")]
    without = jsonschema.Draft7Validator(audit_schema(registry))
    assert ("defenses", 0, "name") in _paths(without, _changed(defenses=[{"name": "mine", "params": {"scale": 0.5}}]))


def _collect_enums(node, out: list) -> None:
    if isinstance(node, dict):
        if "enum" in node:
            out.append(node["enum"])
        for value in node.values():
            _collect_enums(value, out)
    elif isinstance(node, list):
        for value in node:
            _collect_enums(value, out)


def test_starter_audits_validate(validator, registry):
    from pathlib import Path

    from leakaudit.evaluator.audit.yamlfile import parse_yaml
    from leakaudit.evaluator.authoring.starter import starter_audit

    for name in set(registry.names("defense")) - {"nvflare_job"}:  # it reads the team's own job file
        assert _paths(validator, parse_yaml(Path("starter.yaml"), starter_audit(registry, [name]))) == [], name
