"""A JSON Schema (draft-07) of the audit file, built from the specs the loader checks, for editors.

YAML language servers read it to complete keys and registered names and to flag wrong types and ranges while
the file is typed. ``load_audit`` stays the judge: every file it accepts validates here, and it also checks
what a schema cannot say (a factory imports, a chain's members, a label used twice).
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

from leakaudit.evaluator.audit.budget import DURATION
from leakaudit.evaluator.audit.specs import (
    ATTACK,
    DATA,
    DEFAULT_METRICS,
    DEFENSE,
    EXECUTOR,
    FRONTIER,
    MAX_STEPS,
    MEMBER,
    MODEL,
    SETTING_MODEL,
    THREAT,
    TOP,
    UTILITY,
    VERDICT,
)
from leakaudit.evaluator.audit.tuning import SCAN, TUNE
from leakaudit.plugins.manager import Registry
from leakaudit.plugins.protocol import FEDSGD, PROTOCOLS
from leakaudit.plugins.spec import Param

Schema = dict[str, Any]

DRAFT_07 = "http://json-schema.org/draft-07/schema#"
JSON_TYPES = {float: "number", int: "integer", str: "string", bool: "boolean", dict: "object", list: "array"}
OBJECT: Schema = {"type": "object"}


def _or_null(schema: Schema) -> Schema:
    """``schema`` that also takes YAML's null; flat where it can be, so that a problem is reported at its own key
    (a schema that combines others is put beside null instead: those would judge null too)."""
    if any(k in schema for k in ("allOf", "oneOf", "not", "if", "const")):
        return {"anyOf": [schema, {"type": "null"}]}
    out = dict(schema)
    if "anyOf" in out:
        out["anyOf"] = [*out["anyOf"], {"type": "null"}]
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    if "type" in out:
        out["type"] = [*(out["type"] if isinstance(out["type"], list) else [out["type"]]), "null"]
    return out


def param_schema(p: Param) -> Schema:
    """One declared parameter: its type, range, choices, default and help (a type YAML cannot hold: unchecked)."""
    types = p.type if isinstance(p.type, tuple) else (p.type,)
    value: Schema = {}
    if all(t in JSON_TYPES for t in types):
        names = [JSON_TYPES[t] for t in types]
        value["type"] = names[0] if len(names) == 1 else names
    if p.min is not None:
        value["exclusiveMinimum" if p.exclusive_min else "minimum"] = p.min
    if p.max is not None:
        value["maximum"] = p.max
    if p.choices is not None:
        value["enum"] = list(p.choices)
    out = value
    if p.items is not None:
        out = {"anyOf": [value, {"type": "array", "minItems": p.items, "maxItems": p.items, "items": value}]}
    if p.nullable or p.default is None:
        out = _or_null(out)
    if p.help:
        out["description"] = p.help
    if not p.required:
        try:
            out["default"] = json.loads(json.dumps(p.default, allow_nan=False))
        except (TypeError, ValueError):  # a default YAML cannot write: editors go without it
            pass
    return out


def _section(spec: Mapping[str, Param], **override: Schema) -> Schema:
    """A mapping of ``spec``'s keys, unknown ones rejected; ``override`` gives the keys that hold structure
    (null still allowed where the parameter allows it, description and default kept)."""
    properties = {}
    for key, p in spec.items():
        plain = param_schema(p)
        if key not in override:
            properties[key] = plain
            continue
        own = _or_null(override[key]) if p.nullable or p.default is None else override[key]
        properties[key] = {**{k: plain[k] for k in ("description", "default") if k in plain}, **own}
    out: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    required = [k for k, p in spec.items() if p.required]
    if required:
        out["required"] = required
    return out


def _values_of(p: Param) -> Schema:
    """A sweep's or tuning space's values for one parameter: a non-empty list of valid values."""
    return {"type": "array", "minItems": 1, "items": param_schema(p)}


def _with_params(spec: Mapping[str, Param]) -> Schema:
    """What a model, dataset or attack name asks of its entry: ``params`` checked against its own spec."""
    params = _section(spec)
    return {"properties": {"params": params}, **({"required": ["params"]} if "required" in params else {})}


def _swept(spec: Mapping[str, Param]) -> Schema:
    """What a defense name asks of its entry: each parameter in ``params`` or ``sweep`` (not both), required
    ones in either."""
    params = _section(spec)
    params.pop("required", None)
    sweep = {"type": "object", "properties": {k: _values_of(p) for k, p in spec.items()}, "additionalProperties": False}
    rules: list[Schema] = []
    for key, p in spec.items():
        fixed: Schema = {"required": ["params"], "properties": {"params": {"required": [key]}}}
        varied: Schema = {"required": ["sweep"], "properties": {"sweep": {"required": [key]}}}
        searched: Schema = {"required": ["frontier"], "properties": {"frontier": {"properties": {"param": {"const": key}}}}}
        rules.append({"not": {"allOf": [fixed, varied]}})
        if p.required:
            rules.append({"anyOf": [fixed, varied, searched]})
    knobs = [k for k, p in spec.items() if p.protects]
    frontier: Schema = {"properties": {"param": {"enum": knobs}}} if knobs else {"not": {}}  # no knob: no search
    return {"properties": {"params": params, "sweep": sweep, "frontier": frontier},
            **({"allOf": rules} if rules else {})}


def _tuned(spec: Mapping[str, Param]) -> Schema:
    """What an attack name asks of its entry: its ``params``, and ``tune`` searching only its own parameters
    (``priors.tv``: a key inside one)."""
    own: Schema = ({"type": "string", "pattern": f"^(?:{'|'.join(map(re.escape, spec))})(?:\\..*)?$"} if spec
           else {"not": {}})
    tune = {"properties": {"space": {"propertyNames": own, "properties": {k: _values_of(p) for k, p in spec.items()}},
                           "scan": {"properties": {"param": own}}}}
    out = _with_params(spec)
    out["properties"]["tune"] = tune
    return out


def _cases(registry: Registry, kind: str, key: str, then: Callable[[Mapping[str, Param]], Schema]) -> list[Schema]:
    """Per registered name under ``key``: ``if key is the name then`` its parameters' schema and summary."""
    out = []
    for name in registry.names(kind):
        entry = registry.entries[kind][name]
        branch = then(entry.obj.params)
        if entry.summary:
            branch["properties"][key] = {"description": entry.summary}
        out.append({"if": {"required": [key], "properties": {key: {"const": name}}}, "then": branch})
    return out


def _exactly_one(a: str, b: str) -> Schema:
    """One of the two keys set to something other than null, not both."""
    return {"oneOf": [{"required": [k], "properties": {k: {"not": {"type": "null"}}}} for k in (a, b)]}


def _model_schema(spec: Mapping[str, Param], registry: Registry) -> Schema:
    """A model section: a zoo model (or a 'package.module:factory' as its name) or a factory, with its params."""
    name = {"anyOf": [{"enum": registry.names("model")}, {"type": "string", "pattern": ":"}]}
    extra = {"checkpoints": {"type": "array", "uniqueItems": True, "minItems": 1,
                             "items": {"type": "integer", "minimum": 0, "maximum": MAX_STEPS}}}
    out = _section(spec, name=name, params=OBJECT, **{k: v for k, v in extra.items() if k in spec})
    out["allOf"] = [_exactly_one("name", "factory"), *_cases(registry, "model", "name", _with_params)]
    return out


def _bare_name_or(names: list[str], entry: dict) -> dict:
    """A list item that is an entry, or a registered name alone (``attacks: [bayes, cinet]``)."""
    return {"if": {"type": "string"},
            "then": {"description": "a registered name alone: the entry with that name and its defaults", "enum": names},
            "else": entry}


def _defense_schema(registry: Registry) -> Schema:
    """A defense entry: a registered defense with params and sweep, or a chain of them, and its own model."""
    names = registry.names("defense")
    member = _section(MEMBER, name={"enum": names}, params=OBJECT, sweep=OBJECT)
    member["allOf"] = _cases(registry, "defense", "name", _swept)
    bounds = {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "number", "exclusiveMinimum": 0}}
    entry = _section(DEFENSE, name={"anyOf": [{"enum": names}, {"const": ""}]}, params=OBJECT, sweep=OBJECT,
                     chain={"type": "array", "items": member}, model=_model_schema(SETTING_MODEL, registry),
                     frontier=_section(FRONTIER, range=bounds))
    chained = {"required": ["chain"], "properties": {"chain": {"type": "array"}}}
    entry["allOf"] = [*_cases(registry, "defense", "name", _swept), {
        "if": chained,
        "then": {"properties": {"name": {"enum": ["", None]}, "params": {"maxProperties": 0},
                                "sweep": {"maxProperties": 0}}},
        "else": {"required": ["name"], "properties": {"name": {"enum": names}}}}]
    return entry


def _attack_schema(registry: Registry) -> Schema:
    """An attack entry: a registered attack with its params, tuning, and the settings and steps it runs on."""
    image_metrics = [n for n in registry.names("metric") if registry.get("metric", n).on == "images"]
    tune = _section(TUNE, space={"type": "object", "additionalProperties": {"type": "array", "minItems": 1}},
                    metric={"enum": image_metrics}, scan=_section(SCAN))
    scope = {"anyOf": [{"enum": registry.names("defense")}, {"type": "string", "description": "a setting label"}]}
    entry = _section(ATTACK, name={"enum": registry.names("attack")}, params=OBJECT, tune=tune,
                     defenses={"type": "array", "minItems": 1, "items": scope},
                     checkpoints={"type": "array", "minItems": 1,
                                  "items": {"type": "integer", "minimum": 0, "maximum": MAX_STEPS}})
    entry["allOf"] = _cases(registry, "attack", "name", _tuned)
    return entry


def _protocol_schema() -> Schema:
    """``protocol:``: a protocol's name (one that needs no settings) or a mapping of its name and settings."""
    rules = []
    for name, cls in PROTOCOLS.items():
        own = _section(cls.params)
        own["properties"] = {"name": {"const": name}, **own["properties"]}
        named = {"properties": {"name": {"const": name}}, **({} if name == FEDSGD.name else {"required": ["name"]})}
        rules.append({"if": named, "then": own})
    mapping = {"type": "object", "properties": {"name": {"enum": list(PROTOCOLS), "default": FEDSGD.name}},
               "allOf": rules}
    plain = [n for n, c in PROTOCOLS.items() if not any(p.required for p in c.params.values())]
    return {"anyOf": [{"enum": plain}, mapping]}


def _metric_rules(registry: Registry) -> list[Schema]:
    """What depends on the metrics measured (DEFAULT_METRICS when ``metrics:`` is left out): the leakage metric
    is one of them, and each one's smallest image side bounds data.image_size."""
    def measures(name: str) -> Schema:
        listed = {"required": ["metrics"], "properties": {"metrics": {"contains": {"const": name}}}}
        return {"anyOf": [listed, {"not": {"required": ["metrics"]}}]} if name in DEFAULT_METRICS else listed

    size = DATA["image_size"]
    rules = []
    for name in registry.names("metric"):
        rules.append({"if": {"required": ["leakage_metric"], "properties": {"leakage_metric": {"const": name}}},
                      "then": measures(name)})
        least = registry.get("metric", name).min_size
        if least > size.min:
            data = {"properties": {"image_size": {"minimum": least}},
                    **({"required": ["image_size"]} if size.default < least else {})}
            rules.append({"if": measures(name), "then": {"properties": {"data": data}}})
    return rules


def audit_schema(registry: Registry) -> Schema:
    """The audit file's JSON Schema (draft-07) with ``registry``'s names and each plugin's parameters."""
    data = _section(DATA, dataset={"enum": registry.names("dataset")}, params=OBJECT)
    data["allOf"] = [_exactly_one("dataset", "factory"), *_cases(registry, "dataset", "dataset", _with_params)]
    executors = EXECUTOR["name"].choices
    assert executors is not None, "executor.name declares its choices"
    top = _section(
        TOP,
        executor={"anyOf": [{"enum": list(executors)}, _section(EXECUTOR)]},
        max_problems={"anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 1}]},
        budget={"anyOf": [{"type": "string", "pattern": DURATION.pattern}, {"type": "number", "exclusiveMinimum": 0}]},
        data={"description": "the images attacked and trained on: a registered dataset or your own factory",
              **data},
        model={"description": "the model attacked: a zoo model or your own factory, and the training steps "
                              "(checkpoints) it is attacked at", **_model_schema(MODEL, registry)},
        defenses={"description": "the defense settings audited", "type": "array", "minItems": 1,
                  "items": _bare_name_or(registry.names("defense"), _defense_schema(registry))},
        attacks={"description": "the attacks, each run on every setting (or on those its defenses: names); auto "
                                "(the default): every registered attack that applies, at budgets for the device",
                 "if": {"type": "string"}, "then": {"const": "auto"},
                 "else": {"type": "array", "minItems": 1,
                          "items": _bare_name_or(registry.names("attack"), _attack_schema(registry))}},
        utility=_section(UTILITY),
        metrics={"type": "array", "minItems": 1, "items": {"enum": registry.names("metric")}},
        leakage_metric={"enum": registry.names("metric")},
        threat=_section(THREAT),
        protocol=_protocol_schema(),
        verdict=_section(VERDICT),
    )
    top["allOf"] = _metric_rules(registry)
    return {"$schema": DRAFT_07, "title": "leakaudit audit file",
            "description": "An audit of federated-learning privacy defenses against gradient-inversion attacks "
                           "(leakaudit run FILE); leakaudit checks the file in full before any work.",
            **top}
