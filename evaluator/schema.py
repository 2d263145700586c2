"""``leakaudit schema``: the audit file as a JSON Schema (draft-07), for editors' completion and checking.

Built from the same ``Param`` specs that ``config.py`` validates with, so the two cannot drift; the
registered names (plugins included) are enums, and each plugin's own parameters are keyed on its name.
The schema is never stricter than ``load_audit``; what it cannot express (a sweep's values replacing a
required parameter, cross-references such as ``leakage_metric`` being one of ``metrics``) is left to
``leakaudit validate``.
"""
from __future__ import annotations

import json
from typing import Any

from leakaudit.evaluator.config import (
    ATTACK,
    DATA,
    DEFENSE,
    EXECUTOR,
    MAX_STEPS,
    MEMBER,
    MODEL,
    ROLES,
    SETTING_MODEL,
    THREAT,
    TOP,
    UTILITY,
    VERDICT,
)
from leakaudit.evaluator.tuning import SCAN, TUNE
from leakaudit.plugins.manager import Registry
from leakaudit.plugins.protocol import PROTOCOLS
from leakaudit.plugins.spec import Param

JSON_TYPES = {float: "number", int: "integer", str: "string", bool: "boolean", dict: "object", list: "array"}
Schema = dict[str, Any]


def _json_value(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def param_schema(p: Param) -> Schema:
    """One declared parameter: its JSON type(s), range, choices, default and help."""
    types = [JSON_TYPES[t] for t in (p.type if isinstance(p.type, tuple) else (p.type,)) if t in JSON_TYPES]
    one: Schema = {"type": types[0] if len(types) == 1 else types} if types else {}
    if p.min is not None:
        one["exclusiveMinimum" if p.exclusive_min else "minimum"] = p.min
    if p.max is not None:
        one["maximum"] = p.max
    if p.choices:
        one["enum"] = list(p.choices)
    if p.items is not None:
        one = {"anyOf": [one, {"type": "array", "items": one, "minItems": p.items, "maxItems": p.items}]}
    if p.nullable or (not p.required and p.default is None):
        one = {"anyOf": [one, {"type": "null"}]}
    if p.help:
        one["description"] = p.help
    if not p.required and _json_value(p.default):
        one["default"] = p.default
    elif p.example is not None:
        one["examples"] = [p.example]
    return one


def section_schema(spec: dict[str, Param], **override: Schema) -> Schema:
    """A mapping of ``spec``'s keys (no others), its required keys required; ``override`` replaces some keys."""
    properties = {k: override.get(k, param_schema(p)) for k, p in spec.items()}
    required = [k for k, p in spec.items() if p.required]
    return {"type": "object", "properties": properties, "additionalProperties": False,
            **({"required": required} if required else {})}


def _plugin_params(registry: Registry, kind: str, sweep: bool) -> list[Schema]:
    """Per registered plugin: when ``name`` is it, ``params`` (and ``sweep``) take only its parameters."""
    rules = []
    for name in registry.names(kind):
        spec = getattr(registry.get(kind, name), "params", {}) or {}
        then: Schema = {"params": {"type": "object", "additionalProperties": False,
                                   "properties": {k: param_schema(p) for k, p in spec.items()}}}
        if sweep:
            then["sweep"] = {"type": "object", "additionalProperties": False,
                             "properties": {k: {"type": "array", "minItems": 1, "items": param_schema(p)}
                                            for k, p in spec.items()}}
        rules.append({"if": {"properties": {"name": {"const": name}}, "required": ["name"]},
                      "then": {"properties": then}})
    return rules


def _named(registry: Registry, kind: str, spec: dict[str, Param], sweep: bool = False, **override: Schema) -> Schema:
    """An entry that names a registered plugin of ``kind``, with that plugin's parameters."""
    name = {"enum": registry.names(kind), "description": f"a registered {kind} (leakaudit plugins {kind})"}
    if not spec["name"].required:
        name = {"anyOf": [name, {"type": "null"}], "description": name["description"]}
    return {**section_schema(spec, name=name, **override), "allOf": _plugin_params(registry, kind, sweep)}


def _protocol_schema() -> Schema:
    """``protocol:`` a name, or a mapping of a name and that protocol's own settings."""
    keys = {k: param_schema(p) for cls in PROTOCOLS.values() for k, p in cls.params.items()}
    rules = [{"if": {"properties": {"name": {"const": n}}}, "then": {"propertyNames": {"enum": ["name", *cls.params]}}}
             for n, cls in PROTOCOLS.items()]
    mapping = {"type": "object", "additionalProperties": False, "allOf": rules,
               "properties": {"name": {"enum": list(PROTOCOLS), "default": "fedsgd"}, **keys}}
    return {"anyOf": [{"enum": list(PROTOCOLS)}, mapping], "description": TOP["protocol"].help, "default": "fedsgd"}


def audit_schema(registry: Registry) -> Schema:
    """The JSON Schema of an audit file, with ``registry``'s names and parameters."""
    steps = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_STEPS}, "minItems": 1}
    metric = {"enum": registry.names("metric")}
    model = _named(registry, "model", MODEL, checkpoints={**steps, "description": "training steps at which the "
                                                                                   "update is attacked"})
    members = {"type": "array", "minItems": 1, "items": _named(registry, "defense", MEMBER, sweep=True),
               "description": DEFENSE["chain"].help}
    defense = _named(registry, "defense", DEFENSE, sweep=True, chain=members,
                     model=_named(registry, "model", SETTING_MODEL))
    tune = section_schema(TUNE, scan=section_schema(SCAN))
    attack = _named(registry, "attack", ATTACK, tune=tune, role={"enum": list(ROLES)},
                    defenses={"type": "array", "minItems": 1, "items": {"type": "string"},
                              "description": ATTACK["defenses"].help},
                    checkpoints={**steps, "description": ATTACK["checkpoints"].help})
    data = {**section_schema(DATA, dataset={"anyOf": [{"enum": registry.names("dataset")}, {"type": "null"}],
                                             "description": DATA["dataset"].help}),
            "allOf": [{"if": {"properties": {"dataset": {"const": n}}, "required": ["dataset"]},
                       "then": {"properties": {"params": rule["then"]["properties"]["params"]}}}
                      for n, rule in zip(registry.names("dataset"), _plugin_params(registry, "dataset", False))]}
    top = section_schema(
        TOP, data=data, model=model,
        defenses={"type": "array", "minItems": 1, "items": defense},
        attacks={"type": "array", "minItems": 1, "items": attack},
        utility=section_schema(UTILITY), threat=section_schema(THREAT), verdict=section_schema(VERDICT),
        metrics={"type": "array", "minItems": 1, "items": metric, "default": TOP["metrics"].default},
        leakage_metric={"anyOf": [metric, {"type": "null"}], "description": TOP["leakage_metric"].help},
        protocol=_protocol_schema(),
        executor={"anyOf": [{"enum": list(EXECUTOR["name"].choices)}, section_schema(EXECUTOR)],
                  "description": TOP["executor"].help, "default": "local"},
        max_problems={"anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 1}],
                      "description": TOP["max_problems"].help, "default": "auto"},
    )
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": "leakaudit audit file",
            "description": "An audit: which defenses, attacked how, on which images and model "
                           "(leakaudit validate FILE checks what this schema cannot).", **top}
