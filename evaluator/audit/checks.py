"""The checks of each section of an audit file, each appending one line per problem to ``problems``:
registered names (with did-you-mean), factories, sweeps and chains, attack filters, metrics, protocol, device."""
from __future__ import annotations

import contextvars
import dataclasses
import difflib
import importlib.util
import inspect
import itertools
import os
import shutil
from typing import Any

import torch

from leakaudit.evaluator.audit.specs import (
    ATTACK, DEFAULT_LEAKAGE_METRIC, DEFENSE, EXECUTOR, FRONTIER, MAX_STEPS, MEMBER, SETTING_MODEL,
)
from leakaudit.evaluator.audit.tuning import check_tune
from leakaudit.evaluator.audit.types import (
    AttackSpec,
    Audit,
    DefenseSetting,
    ExecutorSection,
    FrontierSpec,
    ModelSection,
    as_dict,
    with_clients,
    world,
)
from leakaudit.plugins.components import ModelSpec
from leakaudit.plugins.factories import import_factory, locate_factory
from leakaudit.plugins.manager import Registry
from leakaudit.plugins.protocol import FEDSGD, PROTOCOLS, Protocol
from leakaudit.plugins.spec import Param, check_params, did_you_mean, one_line
from leakaudit.plugins.text import TASKS


def section(value: Any, spec: dict[str, Param], path: str, problems: list[str]) -> dict[str, Any]:
    """Check a mapping against its spec and return it with defaults filled."""
    if not isinstance(value, dict):
        problems.append(f"{path}: expected a mapping, got {type(value).__name__}")
        return {k: p.default for k, p in spec.items() if not p.required}
    problems.extend(check_params(spec, value, path))
    out = {k: p.default for k, p in spec.items() if not p.required}
    out.update({k: v for k, v in value.items() if k in spec and spec[k].problem(v) is None})
    return out


def checked_section(value: Any, spec: dict[str, Param], path: str, problems: list[str]) -> tuple[dict[str, Any], bool]:
    """``section``, and whether it found nothing wrong (else the checks built on it are skipped: one line each)."""
    found = len(problems)
    out = section(value, spec, path, problems)
    return out, len(problems) == found


#: Whether loading an audit imports the modules its factories name (``run``) or only finds them (``validate``).
IMPORT_USER_CODE: contextvars.ContextVar[bool] = contextvars.ContextVar("leakaudit_import_user_code", default=True)


def _check_factory(section: dict, key: str, path: str, problems: list[str]) -> Any | None:
    """The callable a factory path names (imported), or None where it is only located or has a problem."""
    try:
        return (import_factory if IMPORT_USER_CODE.get() else locate_factory)(section[key])
    except ValueError as exc:
        problems.append(f"{path}: {exc}")
        return None


def _one_of(section: dict, keys: tuple[str, str], where: str, problems: list[str]) -> str | None:
    """The one of ``keys`` that is set; records a problem when neither or both are."""
    given = [k for k in keys if section.get(k) is not None]
    if len(given) != 1:
        problems.append(f"{where}: give exactly one of {keys[0]} or {keys[1]}" + (" (both given)" if given else ""))
        return None
    return given[0]


def _origin(registry: Registry, kind: str, name: str) -> str:
    """A component by its name and where it was registered from: ``attack 'x' (file:/path/plugin.py)``."""
    return f"{kind} {name!r} ({registry.entries[kind][name].origin})"


def _choices(registry: Registry, kind: str) -> str:
    return ", ".join(registry.names(kind))


def _lookup(registry: Registry, kind: str, name: str, where: str, problems: list[str]) -> Any | None:
    """The registered component, or None after recording 'not a registered <kind>; choices: ...'."""
    if not isinstance(name, str):
        problems.append(f"{where}: expected the name of a {kind}, got {name!r}; choices: {_choices(registry, kind)}")
        return None
    if name in registry.entries[kind]:
        return registry.get(kind, name)
    problems.append(f"{where}: {name!r} is not a registered {kind}{did_you_mean(name, registry.names(kind))}; "
                    f"choices: {_choices(registry, kind)}")
    return None


def check_data(data: dict, registry: Registry, problems: list[str]) -> None:
    if data["targets"] % data["batch_size"]:
        problems.append(f"data.targets: {data['targets']} is not a multiple of data.batch_size {data['batch_size']}")
    source = _one_of(data, ("dataset", "factory"), "data", problems)
    if source == "factory":
        _check_factory(data, "factory", "data.factory", problems)
        return
    spec = None if source is None else _lookup(registry, "dataset", data["dataset"], "data.dataset", problems)
    if spec is None:
        return
    problems.extend(check_params(spec.params, data.get("params", {}), "data.params"))
    if spec.check is not None:
        problems.extend(spec.check(data))


def check_model(model: dict, registry: Registry, problems: list[str]) -> None:
    ckpts = model.get("checkpoints", [0])
    if not ckpts:
        problems.append("model.checkpoints: an empty list; give the training steps to attack at, e.g. [0]")
    for i, c in enumerate(ckpts):
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            problems.append(f"model.checkpoints[{i}]: {c!r} is not a training step (an integer >= 0)")
        elif c > MAX_STEPS:
            problems.append(f"model.checkpoints[{i}]: {c} is past the {MAX_STEPS} training steps an audit may ask for")
    if len(set(map(str, ckpts))) != len(ckpts):
        problems.append(f"model.checkpoints: {ckpts} repeats a step")
    elif all(isinstance(c, int) for c in ckpts):
        model["checkpoints"] = sorted(ckpts)
    _check_architecture(model, registry, "model", problems)


def _check_architecture(model: dict, registry: Registry, where: str, problems: list[str]) -> None:
    """A model section's ``name`` (zoo) or ``factory`` and its params; a factory path becomes the name."""
    name = model.get("name")
    source = _one_of(model, ("name", "factory"), where, problems)
    if source is None:
        return
    if source == "factory" or ":" in (name or ""):
        _check_factory(model, source, f"{where}.{source}", problems)
        model["name"] = model[source]  # a factory path is the model's name in reports
        return
    if not isinstance(name, str) or name not in registry.entries["model"]:
        problems.append(f"{where}.name: {name!r} is not a registered model or a 'package.module:factory'"
                        f"{did_you_mean(name, registry.names('model'))}; choices: {_choices(registry, 'model')}")
        return
    spec: ModelSpec = registry.get("model", name)
    problems.extend(check_params(spec.params, model.get("params", {}), f"{where}.params"))
    if spec.check is not None:
        problems.extend(f"{where}.name: {line}" for line in spec.check(model))


def _items(value: Any, what: str, problems: list[str]) -> list[tuple[str, dict]]:
    if value is None:
        problems.append(f"{what}: required, a list of {{name: ...}} entries")
        return []
    if not isinstance(value, list) or not value:
        problems.append(f"{what}: expected a non-empty list, got {value!r}")
        return []
    # a bare name is the entry with that name alone: `attacks: [bayes, cinet]` as `[{name: bayes}, {name: cinet}]`
    return [(f"{what}[{i}]", {"name": item} if isinstance(item, str) else item) for i, item in enumerate(value)]


def expand_defenses(value: Any, registry: Registry, problems: list[str], protocol: Protocol | None = FEDSGD,
                    data: dict | None = None, frontiers: list[FrontierSpec] | None = None) -> list[DefenseSetting]:
    """Every setting the ``defenses:`` entries expand to (sweeps, chains, own models, numbers of clients, the
    ends of each ``frontier:`` search, whose specs go to ``frontiers``). ``protocol`` None: not known yet (a
    monitor before it is attached), so the names and parameters are checked, and what the protocol allows is not."""
    settings: list[DefenseSetting] = []
    for where, item in _items(value, "defenses", problems):
        item, ok = checked_section(item, DEFENSE, where, problems)
        if not ok:
            continue
        if item["frontier"] is not None:
            found = len(problems)
            spec = _frontier(item, registry, where, problems)
            if spec is None:
                continue
            item = {**item, "frontier": None, "sweep": {spec.knob: [spec.low, spec.high]}, "label": None}
            at_ends: list[str] = []
            ends = expand_defenses([item], registry, at_ends, protocol, data)
            problems.extend(_frontier_problems(at_ends, where))
            if len(problems) == found:
                spec = dataclasses.replace(spec, model=ends[0].model, clients=ends[0].clients)
                settings.extend(spec.setting(v) for v in (spec.low, spec.high))
                if frontiers is not None:
                    frontiers.append(spec)
            continue
        if item.get("chain") is not None:
            if item.get("name") or item["params"] or item["sweep"]:
                problems.append(f"{where}: give either name (with params, sweep) or chain, not both")
                continue
            if not item["chain"]:
                problems.append(f"{where}.chain: an empty chain; list the defenses applied in order, e.g. "
                                "[{name: clip, params: {max_norm: 1.0}}, {name: gaussian, params: {sigma: 0.1}}]")
                continue
            options = [_member_options(section(m, MEMBER, f"{where}.chain[{i}]", problems), registry,
                                       f"{where}.chain[{i}]", problems) for i, m in enumerate(item["chain"])]
        elif item.get("name") is None:
            problems.append(f"{where}: name is required (or chain: a list of defenses)")
            continue
        else:
            options = [_member_options(item, registry, where, problems)]
        if any(not o for o in options) or not options:
            continue
        own_model = None
        if item.get("model") is not None:
            own_model = section(item["model"], SETTING_MODEL, f"{where}.model", problems)
            found = len(problems)
            _check_architecture(own_model, registry, f"{where}.model", problems)
            if len(problems) > found:
                continue
        crowds = [None] if protocol is None else _client_counts(item.get("clients"), protocol, data,
                                                               f"{where}.clients", problems)
        if not crowds:
            continue
        combos: list[tuple[Any, ...]] = list(itertools.product(*options, crowds))
        for *members, clients in combos:
            setting = DefenseSetting(tuple(members), item["label"] if len(combos) == 1 else None,
                                     None if own_model is None else ModelSection(**own_model), item["must_protect"],
                                     clients=clients)
            try:
                built = setting.build(registry)
                why = None if protocol is None else built.unsupported(with_clients(protocol, clients))
            except (ValueError, TypeError) as exc:
                why = str(exc)
            except Exception as exc:  # a plugin's constructor failing otherwise: named, on one line
                why = f"{_origin(registry, 'defense', setting.members[-1][0])} raised {one_line(exc)}"
            if why:
                problems.append(f"{where}: {setting.key}: {why}")
                continue
            if any(s.key == setting.key for s in settings):
                problems.append(f"{where}: setting {setting.key} appears twice")
            settings.append(setting)
    return settings


def _frontier(item: dict, registry: Registry, where: str, problems: list[str]) -> FrontierSpec | None:
    """A ``frontier:`` entry's search, checked: one defense, a declared monotone knob, a range in its bounds."""
    path = f"{where}.frontier"
    given = item["frontier"]
    clash = [k for k in ("sweep", "chain", "label") if item.get(k)] + (["must_protect"] if item["must_protect"] else [])
    if clash:
        problems.append(f"{where}: give frontier or {clash[0]}, not both (the search names its settings and "
                        "decides which protects)")
        return None
    if isinstance(item.get("clients"), list):
        problems.append(f"{where}.clients: one number of clients with frontier:, not a list")
        return None
    cls = None if item.get("name") is None else _lookup(registry, "defense", item["name"], f"{where}.name", problems)
    if cls is None:
        if item.get("name") is None:
            problems.append(f"{where}: name is required with frontier:")
        return None
    spec, ok = checked_section(given, FRONTIER, path, problems)
    if not ok:
        return None
    knobs = sorted(k for k, p in cls.params.items() if p.protects)
    knob = cls.params.get(spec["param"])
    if knob is None or not knob.protects:
        what = "not a monotone knob of" if knob is not None else "not a parameter of"
        problems.append(f"{path}.param: {spec['param']!r} is {what} {item['name']}"
                        f"{did_you_mean(spec['param'], knobs)}; choices: "
                        f"{', '.join(knobs) or '(none: it declares no parameter with protects)'}")
        return None
    bounds = spec["range"]
    if (len(bounds) != 2 or any(knob.problem(v) for v in bounds) or not all(v > 0 for v in bounds)
            or not bounds[0] < bounds[1]):
        why = next((knob.problem(v) for v in bounds if knob.problem(v)), None) if len(bounds) == 2 else None
        problems.append(f"{path}.range: {bounds!r}: expected [low, high] with 0 < low < high"
                        f"{f' ({why})' if why else ''}; {spec['param']}: {knob.describe()}")
        return None
    if spec["param"] in item["params"]:
        problems.append(f"{where}.params.{spec['param']}: the frontier's knob; leave it out of params")
        return None
    return FrontierSpec(where, item["name"], dict(item["params"]), spec["param"], bounds[0], bounds[1],
                        spec["tolerance"], spec["probes"], knob.protects, knob.type is int)


def _frontier_problems(found: list[str], where: str) -> list[str]:
    """The problems of a frontier's two ends, expanded as the one entry ``defenses[0]``: named by the entry's own
    place, and a line the ends share (a setting neither end can build) said once, for the first."""
    out: list[str] = []
    for line in found:
        line = where + line.removeprefix("defenses[0]")
        if not (line.startswith(f"{where}: ") and any(o.startswith(f"{where}: ") for o in out)):
            out.append(line)
    return out


def _client_counts(value: Any, protocol: Protocol, data: dict | None, path: str,
                   problems: list[str]) -> list[int | None]:
    """The numbers of clients an entry's ``clients:`` names ([None]: the protocol's); [] after a problem."""
    if value is None:
        return [None]
    counts = value if isinstance(value, list) else [value]
    found = len(problems)
    if not hasattr(protocol, "clients"):
        problems.append(f"{path}: secure aggregation needs protocol fedavg (protocol: {{name: fedavg, ...}}); "
                        f"protocol {protocol.name} has no clients")
    elif not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        problems.append(f"{path}: expected a number of clients of at least 1, or a list of them; got {value!r}")
    elif len(set(counts)) < len(counts):
        problems.append(f"{path}: {value!r} names a number of clients twice")
    elif data is not None:
        each = data["batch_size"] // protocol.clients
        for n in counts:
            if data["targets"] % (n * each):
                problems.append(f"{path}: {n} clients of {each} image(s) each (data.batch_size / protocol.clients) "
                                f"make updates of {n * each} images, which data.targets {data['targets']} is not a "
                                "multiple of")
    return counts if len(problems) == found else []


def with_references(settings: list[DefenseSetting], attacks: list[AttackSpec],
                    registry: Registry) -> list[DefenseSetting]:
    """``settings`` with an undefended reference for each model and number of clients they run on, which
    calibrates the verdicts: the audit's own undefended setting of that world, else one added at the end
    (marked ``added``).

    A reference is attacked by every attack that runs on a setting of its model and supports the undefended
    update (attacks that read what a defense adds to the model, ``needs_defense``, do not), with the same
    budget and tuning: where none of them breaks it, a defended setting's "protects" at that step cannot be
    told from a weak attack. Where no attack can run undefended, none is added (every "protects" of that model
    is then inconclusive).
    """
    baseline = next((e.obj for e in registry.entries["defense"].values() if e.obj.baseline), None)
    if baseline is None or not settings:
        return settings
    reference, out = baseline(), []
    worlds = list({world(s): s for s in settings}.items())
    for key, first in worlds:
        mine = [s for s in settings if world(s) == key]
        given = next((s for s in mine if s.is_baseline(registry)), None)
        labels = frozenset(a.label for a in attacks if (given is not None and a.filters_in(given)) or (
            any(a.filters_in(s) for s in mine) and _calibrates(a.build(registry), reference)))
        if given is not None:
            settings = [dataclasses.replace(s, calibrates=labels) if s is given else s for s in settings]
        elif labels:
            out.append(DefenseSetting(((baseline.name, {}),), None, first.model, False, labels, True, first.clients))
    return settings + out


def _calibrates(attack: Any, reference: Any) -> bool:
    """Whether a (filtered) attack can also run on the undefended update."""
    return not attack.needs_defense and attack.unsupported_defense(reference) is None


def _member_options(item: dict, registry: Registry, where: str, problems: list[str]) -> list[tuple[str, dict]]:
    """Every (name, params) that one defense entry's sweep expands to; [] after a problem."""
    name = item.get("name")
    cls = None if name is None else _lookup(registry, "defense", name, f"{where}.name", problems)
    if cls is None:
        return []
    spec = cls.params
    sweep = item["sweep"]
    found = _check_sweep(spec, item["params"], sweep, where) if sweep else check_params(spec, item["params"],
                                                                                          f"{where}.params")
    if found:
        problems.extend(found)
        return []
    keys = sorted(sweep)
    return [(str(name), {**item["params"], **dict(zip(keys, combo))})
            for combo in itertools.product(*(sweep[k] for k in keys))]


def _check_sweep(spec: dict[str, Param], params: dict, sweep: dict, where: str) -> list[str]:
    """A sweep and the params beside it: one line per key, a key in both named once (which to keep), a misspelt
    sweep key with its did-you-mean (and the parameter it was meant for not reported missing from params)."""
    out = []
    meant = set()
    for key, values in sweep.items():
        if key not in spec:
            meant.update(difflib.get_close_matches(key, list(spec), n=1, cutoff=0.6))  # what did_you_mean names
            out.append(f"{where}.sweep.{key}: unknown parameter{did_you_mean(key, spec)}; choices: {', '.join(sorted(spec)) or '(none)'}")
        elif key in params:
            out.append(f"{where}.sweep.{key}: given twice, in {where}.params and in {where}.sweep; keep one: "
                       f"params for one value, sweep for a list of them")
        elif not isinstance(values, list) or not values:
            out.append(f"{where}.sweep.{key}: expected a non-empty list of values, got {values!r}")
        else:
            out.extend(f"{where}.sweep.{key}[{i}]: {why}" for i, v in enumerate(values)
                       if (why := spec[key].problem(v)))
    rest = {k: p for k, p in spec.items() if k not in sweep and k not in meant}
    return check_params(rest, {k: v for k, v in params.items() if k not in sweep or k not in spec},
                        f"{where}.params") + out


def check_attacks(value: Any, registry: Registry, problems: list[str],
                   model_checkpoints: list[int] | None) -> list[AttackSpec]:
    """The attack entries; ``model_checkpoints`` is None where the model section was already reported."""
    specs: list[AttackSpec] = []
    for where, item in _items(value, "attacks", problems):
        item, ok = checked_section(item, ATTACK, where, problems)
        if not ok:
            continue
        name = item.get("name")
        cls = None if name is None else _lookup(registry, "attack", name, f"{where}.name", problems)
        if name is None or cls is None:
            continue
        found = check_params(cls.params, item["params"], f"{where}.params")
        if found:
            problems.extend(found)
            continue
        try:
            attack = cls(**item["params"])
        except (ValueError, TypeError) as exc:
            problems.append(f"{where}.params: {exc}")
            continue
        except Exception as exc:  # a plugin's constructor failing otherwise: named, on one line
            problems.append(f"{where}.params: {_origin(registry, 'attack', str(name))} raised {one_line(exc)}")
            continue
        defenses = _defense_names(item["defenses"], f"{where}.defenses", problems)
        tune = None
        if item.get("tune") is not None:
            metrics = {e.name: e.obj for e in registry.entries["metric"].values()}
            tune, found = check_tune(item["tune"], cls, item["params"], metrics, f"{where}.tune")
            if found:
                problems.extend(found)
                continue
        label = item["label"] or name
        if any(s.label == label for s in specs):
            problems.append(f"{where}.label: attack label {label!r} is used twice; give each a distinct label")
            continue
        role = item["role"] or ("adaptive" if attack.knows_defense else "naive")
        checkpoints = _attack_checkpoints(item["checkpoints"], model_checkpoints, f"{where}.checkpoints", problems)
        specs.append(AttackSpec(name, dict(item["params"]), label, tune, defenses, role, checkpoints))
    return specs


def _attack_checkpoints(value: list | None, model_checkpoints: list[int] | None, where: str,
                        problems: list[str]) -> tuple[int, ...] | None:
    """The training steps an attack is restricted to: a non-empty subset of the model's checkpoints."""
    if value is None or model_checkpoints is None:
        return None
    wrong = [c for c in value if c not in model_checkpoints or isinstance(c, bool)] if value else [None]
    if wrong:
        problems.append(f"{where}: expected a non-empty list of steps from model.checkpoints, got {value!r}; "
                        f"choices: {', '.join(map(str, model_checkpoints))}")
        return None
    return tuple(sorted(set(value)))


def _defense_names(value: list | None, where: str, problems: list[str]) -> tuple[str, ...] | None:
    """The defense names or setting labels an attack is restricted to (checked in ``check_attack_scope``)."""
    if value is None:
        return None
    if not value or not all(isinstance(n, str) for n in value):
        problems.append(f"{where}: expected a non-empty list of defense names or setting labels, got {value!r}")
        return None
    return tuple(value)


def check_attack_scope(attacks: list[AttackSpec], settings: list[DefenseSetting], registry: Registry,
                        problems: list[str]) -> None:
    """Each name in an attack's ``defenses:`` is a defense or a setting label, and the attack runs somewhere."""
    labels = sorted(s.label for s in settings if s.label)
    for i, a in enumerate(attacks):
        unknown = [n for n in a.defenses or () if n not in registry.entries["defense"] and n not in labels]
        for n in unknown:
            choices = [*registry.names("defense"), *labels]
            problems.append(f"attacks[{i}].defenses: {n!r} is not a registered defense or a setting label"
                            f"{did_you_mean(n, choices)}; choices: {', '.join(choices)}")
        if a.defenses is not None and not unknown and settings and not any(a.applies_to(s) for s in settings):
            problems.append(f"attacks[{i}].defenses: no setting of this audit uses "
                            f"{', '.join(a.defenses)}; defenses here: {', '.join(sorted({s.name for s in settings}))}")


def fitting_metrics(names: list[str], registry: Registry, image_size: int) -> tuple[list[str], tuple[str, ...]]:
    """The default metrics that score images of ``image_size`` px, and a note for each left out: a default the user
    never wrote is dropped where it cannot run, as a listed one is refused."""
    kept = [m for m in names if registry.get("metric", m).min_size <= image_size]
    return kept, tuple(f"metrics: {m} left out of the default metrics: it needs images of at least "
                       f"{registry.get('metric', m).min_size} px and data.image_size is {image_size} (list it under "
                       "metrics: at a larger image_size)" for m in names if m not in kept)


def check_metrics(value: Any, registry: Registry, problems: list[str], image_size: int | None = None) -> list[str]:
    if not isinstance(value, list) or not value:
        problems.append(f"metrics: expected a non-empty list of names, got {value!r}")
        return []
    for i, m in enumerate(value):
        metric = _lookup(registry, "metric", m, f"metrics[{i}]", problems)
        if metric is not None and image_size is not None and image_size < metric.min_size:
            problems.append(f"metrics[{i}]: {m} needs images of at least {metric.min_size} px and data.image_size "
                            f"is {image_size}; drop {m} or raise data.image_size")
    return list(value)


def check_leakage_metric(value: str | None, metrics: list[str], registry: Registry, problems: list[str]) -> str:
    """The metric that ranks attacks: ``leakage_metric:``, else the default one when measured, else the first."""
    if value is None:
        return DEFAULT_LEAKAGE_METRIC if DEFAULT_LEAKAGE_METRIC in metrics or not metrics else metrics[0]
    if value not in metrics:
        problems.append(f"leakage_metric: {value!r} is not one of this audit's metrics; choices: {', '.join(metrics)}")
    return value


def check_executor(value: Any, device: str, problems: list[str]) -> ExecutorSection:
    """``executor:`` as a full section (a name alone takes the defaults); Ray must be installed to be named."""
    value = {"name": value} if isinstance(value, str) else value if isinstance(value, dict) else {}
    found = check_params(EXECUTOR, value, "executor")
    problems.extend(found)
    section = {k: p.default for k, p in EXECUTOR.items()} | ({} if found else value)
    if section["num_gpus"] is None:
        section["num_gpus"] = 1.0 if device == "cuda" else 0.0
    if section["name"] == "ray" and importlib.util.find_spec("ray") is None:
        problems.append("executor: ray needs Ray, which is not installed: pip install 'leakaudit[ray]'")
    return ExecutorSection(**section)


def check_protocol(value: Any, data: dict, problems: list[str]) -> Protocol:
    """The protocol type named by ``protocol:`` (a name or a mapping), built from its own ``params``."""
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        return FEDSGD
    name = value.get("name", "fedsgd")
    cls = PROTOCOLS.get(name) if isinstance(name, str) else None
    if cls is None:
        problems.append(f"protocol.name: {name!r} is not a protocol{did_you_mean(name, PROTOCOLS)}; "
                        f"choices: {', '.join(PROTOCOLS)}")
        return FEDSGD
    settings = {k: v for k, v in value.items() if k != "name"}
    owners = {k: n for n, c in PROTOCOLS.items() for k in c.params}
    for key in [k for k in settings if k not in owners]:
        problems.append(f"protocol.{key}: unknown key{did_you_mean(key, ['name', *owners])}; choices: name, "
                        f"{', '.join(cls.params) or '(no settings for ' + name + ')'}")
        del settings[key]
    for key in sorted(k for k in settings if k not in cls.params and k in owners):
        problems.append(f"protocol.{key}: only applies to protocol {owners[key]}")
        del settings[key]
    found = check_params(cls.params, settings, "protocol")
    if found:
        problems.extend(p.replace("required parameter is missing", f"required for protocol {name}") for p in found)
        return FEDSGD
    section = {k: p.default for k, p in cls.params.items() if not p.required} | settings
    if "function" in section:
        _check_step_signature(_check_factory(section, "function", "protocol.function", problems), section["function"],
                              problems)
    clients = section.get("clients", 1)
    if isinstance(clients, int) and clients > 1 and data["batch_size"] % clients:
        problems.append(f"protocol.clients: {clients} clients cannot share data.batch_size {data['batch_size']} "
                        "images equally; make data.batch_size a multiple of clients")
    b = section.get("local_batch_size")
    if b is not None and isinstance(clients, int) and clients >= 1 and b > data["batch_size"] // clients:
        problems.append(f"protocol.local_batch_size: {b} is larger than the {data['batch_size'] // clients} images "
                        "each client holds (data.batch_size / protocol.clients)")
    return cls(**section)


def _check_step_signature(function: Any, path: str, problems: list[str]) -> None:
    """A user's step function must take ``(model, inputs, labels)``, as the client and the attacks call it."""
    if not callable(function):
        return
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: it is called and checked before the first job
        return
    try:
        signature.bind(None, None, None)
    except TypeError:
        problems.append(f"protocol.function: {path} takes {signature}; leakaudit calls it as function(model, inputs, "
                        "labels)")


def check_max_problems(value: Any, problems: list[str]) -> int | None:
    """``max_problems``: 'auto' (None) or a whole number of at least 1."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(f"max_problems: {value!r} is neither 'auto' nor a whole number >= 1; choices: auto, 1, 2, ...")
        return None
    return value


def check_compile(enabled: Any, device: str, problems: list[str]) -> None:
    """``compile: true`` on a CPU needs a C++ compiler for torch.compile's generated kernels: said before any work."""
    if enabled is True and device == "cpu":
        candidates = [os.environ.get("CXX"), "g++", "c++", "clang++"]
        if not any(c and shutil.which(c) for c in candidates):
            problems.append("compile: true needs a C++ compiler on a CPU (torch.compile builds its kernels with it) and "
                            "none was found ($CXX, g++, c++, clang++); install one or set compile: false")


def check_precision(precision: Any, device: str, problems: list[str]) -> None:
    """``precision: bfloat16`` on a GPU without bfloat16 arithmetic would be emulated, slower than float32: refused."""
    if precision == "bfloat16" and device == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
        problems.append(f"precision: bfloat16 but {torch.cuda.get_device_name()} has no bfloat16 arithmetic; "
                        "choices: float32, bfloat16 (on a GPU that has it)")


def check_device(device: str, problems: list[str]) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        problems.append("device: 'cuda' but no CUDA device is available here; choices: auto, cpu, cuda")
    return device


def data_modality(data: dict, registry: Registry) -> str:
    """What the audit's examples are: its registered dataset's modality ("image" for a ``data.factory``, which
    is checked when loaded)."""
    name = data.get("dataset")
    if data.get("factory") or not isinstance(name, str) or name not in registry.entries["dataset"]:
        return "image"
    return registry.get("dataset", name).modality


def audit_modality(audit: Audit) -> str:
    """What an audit's examples are: a monitored loop's as it recorded them, else its dataset's."""
    if audit.live is not None:
        return audit.live.get("modality", "image")
    return data_modality(as_dict(audit.data), audit.registry)


def example_unit(audit: Audit) -> str:
    """What one of the audit's examples is called in reports and verdicts: "sentence" or "image"."""
    return "sentence" if audit_modality(audit) == "text" else "image"


def check_modality(modality: str, data: dict, model: dict, settings: list[DefenseSetting],
                   attacks: list[AttackSpec], metrics: list[str], registry: Registry, problems: list[str],
                   holds: str | None = None) -> None:
    """Every model, defense, attack and metric of the audit applies to its data's examples: one line each that
    does not, naming the data (or what ``holds`` says of the examples) and the registered ones that would."""
    holds = holds or f"data.dataset {data.get('dataset')} holds {modality}"

    def fitting(kind: str, fits) -> str:
        return ", ".join(n for n in registry.names(kind) if fits(registry.get(kind, n))) or "none registered"

    models = [("model", model)] + [(f"defenses ({s.key}).model", dataclasses.asdict(s.model))
                                   for s in settings if s.model is not None]
    for where, section in models:
        name = section.get("name")
        if isinstance(name, str) and name in registry.entries["model"] and \
                registry.get("model", name).modality != modality:
            problems.append(f"{where}.name: {name} reads {registry.get('model', name).modality}; {holds} "
                            f"(models for {modality}: {fitting('model', lambda m: m.modality == modality)})")
        elif modality == "text" and isinstance(name, str) and name in registry.entries["model"]:
            task, learns = (data.get("params") or {}).get("task", "classify"), registry.get("model", name).task
            if learns != task and task in TASKS:  # a task not among them is the data section's own line
                problems.append(f"{where}.name: {name} learns {learns}; data.params.task is {task} (models for "
                                f"{task}: {fitting('model', lambda m: m.modality == 'text' and m.task == task)})")
    for s in settings:
        for name, _ in s.members:
            if isinstance(name, str) and name in registry.entries["defense"] and \
                    modality not in registry.get("defense", name).modalities:
                problems.append(f"defenses ({s.key}): {name} applies to "
                                f"{' and '.join(registry.get('defense', name).modalities)}; {holds}")
    for i, a in enumerate(attacks):
        if isinstance(a.name, str) and a.name in registry.entries["attack"] and \
                registry.get("attack", a.name).modality != modality:
            problems.append(f"attacks[{i}]: {a.name} reconstructs {registry.get('attack', a.name).modality}; "
                            f"{holds} (attacks for {modality}: "
                            f"{fitting('attack', lambda c: c.modality == modality)})")
    for i, m in enumerate(metrics):
        if isinstance(m, str) and m in registry.entries["metric"] and \
                registry.get("metric", m).modality not in (modality, "any"):
            problems.append(f"metrics[{i}]: {m} scores {registry.get('metric', m).modality}; {holds} (metrics "
                            f"for {modality}: {fitting('metric', lambda x: x.modality in (modality, 'any'))})")
