"""Audit files: YAML loaded and validated in full before any work, one line per problem."""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from evaluator.models import ModelSpec, import_factory
from plugins.manager import Registry, load_registry
from plugins.spec import Param, PluginError, check_params

DEFAULT_METRICS = ["psnr", "ssim", "mse", "lpips", "label_accuracy"]

TOP = {
    "name": Param(type=str, help="audit name, shown in reports"),
    "seed": Param(0, int, min=0, help="seed of every random draw"),
    "device": Param("auto", str, choices=("auto", "cpu", "cuda")),
    "workers": Param(None, int, min=1, help="attack processes (default: one per core on the CPU, 1 on CUDA)"),
    "plugins_dir": Param(None, str, help="folder of drop-in *.py plugins, relative to this file"),
    "data": Param(type=dict),
    "model": Param(type=dict),
    "defenses": Param(type=list),
    "attacks": Param(type=list),
    "utility": Param({}, dict),
    "metrics": Param(list(DEFAULT_METRICS), list),
    "threat": Param({}, dict),
}
DATA = {
    "dataset": Param(type=str),
    "image_size": Param(32, int, min=8, max=1024),
    "targets": Param(4, int, min=1, help="private images attacked"),
    "batch_size": Param(1, int, min=1, help="images per shared update"),
    "root": Param(None, str),
    "download": Param(False, bool),
    "params": Param({}, dict),
}
MODEL = {"name": Param(type=str), "params": Param({}, dict), "checkpoints": Param([0], list)}
DEFENSE = {"name": Param(type=str), "params": Param({}, dict), "sweep": Param({}, dict), "label": Param(None, str)}
ATTACK = {"name": Param(type=str), "params": Param({}, dict), "label": Param(None, str)}
UTILITY = {
    "train_steps": Param(200, int, min=0, help="SGD steps of utility training under the defense"),
    "batch_size": Param(32, int, min=1),
    "lr": Param(0.1, float, min=0.0, exclusive_min=True),
    "momentum": Param(0.0, float, min=0.0, max=1.0),
}
THREAT = {"known_labels": Param(False, bool, help="the attacker is given the true labels")}


class ConfigError(Exception):
    """Problems found in an audit file, one line each: '<file>: <key path>: <what is wrong>'."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


@dataclass(frozen=True)
class DefenseSetting:
    """One point of a defense sweep."""

    name: str
    params: dict[str, Any]
    label: str | None = None

    @property
    def key(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return self.label or (f"{self.name}({args})" if args else self.name)


@dataclass(frozen=True)
class AttackSpec:
    name: str
    params: dict[str, Any]
    label: str

    @property
    def key(self) -> str:
        return self.label


@dataclass
class Audit:
    """A validated audit file with defaults filled in and sweeps expanded."""

    path: Path
    text: str
    name: str
    seed: int
    device: str
    workers: int
    plugins_dirs: list[Path]
    data: dict[str, Any]
    model: dict[str, Any]
    settings: list[DefenseSetting]
    attacks: list[AttackSpec]
    utility: dict[str, Any]
    metrics: list[str]
    threat: dict[str, Any]
    registry: Registry = field(repr=False, default=None)

    @property
    def checkpoints(self) -> list[int]:
        return self.model["checkpoints"]

    @property
    def num_batches(self) -> int:
        return self.data["targets"] // self.data["batch_size"]

    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def _section(value: Any, spec: dict[str, Param], path: str, problems: list[str]) -> dict[str, Any]:
    """Check a mapping against its spec and return it with defaults filled."""
    if not isinstance(value, dict):
        problems.append(f"{path}: expected a mapping, got {type(value).__name__}")
        return {k: p.default for k, p in spec.items() if not p.required}
    problems.extend(check_params(spec, value, path))
    out = {k: p.default for k, p in spec.items() if not p.required}
    out.update({k: v for k, v in value.items() if k in spec and spec[k].problem(v) is None})
    return out


def _strip(path: str) -> str:
    return path[1:] if path.startswith(".") else path


def read_yaml(path: Path) -> tuple[str, Any]:
    """The file's text and parsed content; a ConfigError when it is missing or not YAML."""
    if not path.is_file():
        raise ConfigError([f"{path}: file not found"])
    text = path.read_text()
    try:
        return text, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise ConfigError([f"{path}: {where}: not valid YAML: {getattr(exc, 'problem', exc)}"]) from None


def load_audit(path: str | Path, plugins_dirs: list[str | Path] = (), registry: Registry | None = None) -> Audit:
    """Read, validate and expand an audit file; raise ConfigError listing every problem."""
    path = Path(path)
    text, raw = read_yaml(path)
    problems: list[str] = []
    top = _section(raw if raw is not None else {}, TOP, "", problems)
    dirs = [Path(d) for d in plugins_dirs]
    if top.get("plugins_dir"):
        dirs.append((path.parent / top["plugins_dir"]).resolve())
    if registry is None:
        try:
            registry = load_registry(dirs)
        except PluginError as exc:
            raise ConfigError([f"{path}: plugins_dir: {exc}" if top.get("plugins_dir") else f"{path}: {exc}"]) from None
    data = _section(top.get("data", {}), DATA, "data", problems)
    model = _section(top.get("model", {}), MODEL, "model", problems)
    utility = _section(top.get("utility", {}), UTILITY, "utility", problems)
    threat = _section(top.get("threat", {}), THREAT, "threat", problems)
    _check_data(data, registry, problems)
    _check_model(model, registry, problems)
    settings = _expand_defenses(top.get("defenses"), registry, problems)
    attacks = _check_attacks(top.get("attacks"), registry, problems)
    metrics = _check_metrics(top.get("metrics", DEFAULT_METRICS), registry, problems)
    device = _check_device(top.get("device", "auto"), problems)
    workers = top.get("workers") or (1 if device == "cuda" else len(os.sched_getaffinity(0)))
    if problems:
        raise ConfigError([f"{path}: {_strip(p)}" for p in problems])
    return Audit(path, text, top["name"], top["seed"], device, workers, dirs, data, model, settings,
                 attacks, utility, metrics, threat, registry)


def _choices(registry: Registry, kind: str) -> str:
    return ", ".join(registry.names(kind))


def _check_data(data: dict, registry: Registry, problems: list[str]) -> None:
    name = data.get("dataset")
    if name is None:
        return
    if name not in registry.entries["dataset"]:
        problems.append(f"data.dataset: {name!r} is not a registered dataset; choices: {_choices(registry, 'dataset')}")
        return
    spec = registry.get("dataset", name)
    problems.extend(check_params(spec.params, data.get("params", {}), "data.params"))
    if spec.check is not None:
        problems.extend(spec.check(data))
    if data["targets"] % data["batch_size"]:
        problems.append(f"data.targets: {data['targets']} is not a multiple of data.batch_size {data['batch_size']}")


def _check_model(model: dict, registry: Registry, problems: list[str]) -> None:
    name = model.get("name")
    ckpts = model.get("checkpoints", [0])
    for i, c in enumerate(ckpts):
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            problems.append(f"model.checkpoints[{i}]: {c!r} is not a training step (an integer >= 0)")
    if len(set(map(str, ckpts))) != len(ckpts):
        problems.append(f"model.checkpoints: {ckpts} repeats a step")
    elif all(isinstance(c, int) for c in ckpts):
        model["checkpoints"] = sorted(ckpts)
    if name is None:
        return
    if ":" in name:
        try:
            import_factory(name)
        except ValueError as exc:
            problems.append(f"model.name: {exc}")
        return
    if name not in registry.entries["model"]:
        problems.append(f"model.name: {name!r} is not a registered model or a 'package.module:factory'; "
                        f"choices: {_choices(registry, 'model')}")
        return
    spec: ModelSpec = registry.get("model", name)
    problems.extend(check_params(spec.params, model.get("params", {}), "model.params"))


def _items(value: Any, what: str, problems: list[str]) -> list[tuple[str, dict]]:
    if value is None:
        problems.append(f"{what}: required, a list of {{name: ...}} entries")
        return []
    if not isinstance(value, list) or not value:
        problems.append(f"{what}: expected a non-empty list, got {value!r}")
        return []
    return [(f"{what}[{i}]", item) for i, item in enumerate(value)]


def _expand_defenses(value: Any, registry: Registry, problems: list[str]) -> list[DefenseSetting]:
    settings: list[DefenseSetting] = []
    for where, item in _items(value, "defenses", problems):
        item = _section(item, DEFENSE, where, problems)
        name = item.get("name")
        if name is None:
            continue
        if name not in registry.entries["defense"]:
            problems.append(f"{where}.name: {name!r} is not a registered defense; "
                            f"choices: {_choices(registry, 'defense')}")
            continue
        cls = registry.get("defense", name)
        sweep = item["sweep"]
        bad = len(problems)
        problems.extend(check_params(cls.params, item["params"], f"{where}.params")
                        if not sweep else _check_sweep(cls.params, item["params"], sweep, where))
        if len(problems) > bad:
            continue
        keys = sorted(sweep)
        for combo in itertools.product(*(sweep[k] for k in keys)) if keys else [()]:
            params = {**item["params"], **dict(zip(keys, combo))}
            label = item["label"] if not keys else None
            setting = DefenseSetting(name, params, label)
            try:
                cls(**params)
            except (ValueError, TypeError) as exc:
                problems.append(f"{where}: {setting.key}: {exc}")
                continue
            if any(s.key == setting.key for s in settings):
                problems.append(f"{where}: setting {setting.key} appears twice")
            settings.append(setting)
    return settings


def _check_sweep(spec: dict[str, Param], params: dict, sweep: dict, where: str) -> list[str]:
    out = check_params({k: p for k, p in spec.items() if k not in sweep}, params, f"{where}.params")
    for key, values in sweep.items():
        if key not in spec:
            out.append(f"{where}.sweep.{key}: unknown parameter; choices: {', '.join(sorted(spec)) or '(none)'}")
        elif not isinstance(values, list) or not values:
            out.append(f"{where}.sweep.{key}: expected a non-empty list of values, got {values!r}")
        else:
            out.extend(f"{where}.sweep.{key}[{i}]: {why}" for i, v in enumerate(values)
                       if (why := spec[key].problem(v)))
    return out


def _check_attacks(value: Any, registry: Registry, problems: list[str]) -> list[AttackSpec]:
    specs: list[AttackSpec] = []
    for where, item in _items(value, "attacks", problems):
        item = _section(item, ATTACK, where, problems)
        name = item.get("name")
        if name is None:
            continue
        if name not in registry.entries["attack"]:
            problems.append(f"{where}.name: {name!r} is not a registered attack; choices: {_choices(registry, 'attack')}")
            continue
        cls = registry.get("attack", name)
        found = check_params(cls.params, item["params"], f"{where}.params")
        if found:
            problems.extend(found)
            continue
        label = item["label"] or name
        if any(s.label == label for s in specs):
            problems.append(f"{where}.label: attack label {label!r} is used twice; give each a distinct label")
            continue
        specs.append(AttackSpec(name, dict(item["params"]), label))
    return specs


def _check_metrics(value: Any, registry: Registry, problems: list[str]) -> list[str]:
    if not isinstance(value, list) or not value:
        problems.append(f"metrics: expected a non-empty list of names, got {value!r}")
        return []
    for i, m in enumerate(value):
        if m not in registry.entries["metric"]:
            problems.append(f"metrics[{i}]: {m!r} is not a registered metric; choices: {_choices(registry, 'metric')}")
    return list(value)


def _check_device(device: str, problems: list[str]) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        problems.append("device: 'cuda' but no CUDA device is available here; choices: auto, cpu, cuda")
    return device
