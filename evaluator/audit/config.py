"""Audit files: YAML loaded and validated in full before any work, one line per problem."""
from __future__ import annotations

import contextvars
import dataclasses
import importlib.util
import inspect
import itertools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from leakaudit.evaluator.audit.tuning import TuneSpec, check_tune
from leakaudit.plugins.components import ModelSpec
from leakaudit.plugins.factories import import_factory, locate_factory
from leakaudit.plugins.manager import Registry, load_registry
from leakaudit.plugins.protocol import FEDSGD, PROTOCOLS, Protocol
from leakaudit.plugins.spec import Param, PluginError, check_params, did_you_mean, one_line

DEFAULT_METRICS = ["psnr", "ssim", "mse", "lpips", "label_accuracy"]
#: Training steps an audit may ask for (checkpoints, utility.train_steps): past this a run is a hang, not an audit.
MAX_STEPS = 100_000
#: Private images an audit may attack: past this a run is a hang, not an audit.
MAX_TARGETS = 100_000
#: Audit files larger than this are refused unread; YAML aliases may expand to at most this many values.
MAX_FILE_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000
#: Problems listed one per line; the rest are counted.
MAX_PROBLEMS_SHOWN = 20
MAX_LINE = 400

TOP = {
    "name": Param(type=str, help="audit name, shown in reports"),
    "seed": Param(0, int, min=0, help="seed of every random draw"),
    "device": Param("auto", str, choices=("auto", "cpu", "cuda")),
    "deterministic": Param(True, bool, help="on CUDA, deterministic kernels: the same numbers on every run, "
                                            "several times slower (false: faster, reruns differ slightly)"),
    "workers": Param(None, int, min=1, help="worker processes (default: auto: one per visible GPU on CUDA; on the "
                                            "CPU, one per core, but no more than the settings and cells to run "
                                            "nor than their work pays process starts for: a small audit runs in "
                                            "this process alone)"),
    "executor": Param("local", (str, dict), help="local (worker processes on this machine) or ray (tasks on a Ray "
                                                 "cluster), or a mapping: {name: ray, address: auto, ...}"),
    "max_problems": Param("auto", (str, int), help="problems (targets x restarts x tuning trials) an attack "
                                                   "optimises together: auto (what fits in free memory) or a number"),
    "plugins_dir": Param(None, str, help="folder of drop-in *.py plugins, relative to this file"),
    "data": Param(type=dict),
    "model": Param(type=dict),
    "defenses": Param(type=list),
    "attacks": Param(type=list),
    "utility": Param({}, dict),
    "metrics": Param(list(DEFAULT_METRICS), list),
    "leakage_metric": Param(None, str, help="the metric that ranks attacks and draws the privacy axis "
                                            "(default: psnr when measured, else the first of metrics)"),
    "threat": Param({}, dict),
    "protocol": Param("fedsgd", (str, dict), help="fedsgd | fedavg | step, or a mapping with their settings"),
    "verdict": Param({}, dict, help="thresholds of the report's verdicts (evaluator/results/verdict.py)"),
    "architecture": Param("auto", (str, bool), choices=("auto", True, False),
                          help="the report's architecture analysis (Chen & Campbell 2022: each convolution's "
                               "linear system and its rank): auto (when an attack of the audit solves those "
                               "systems), true or false; its exact ranks can take seconds per model"),
}
EXECUTOR = {
    "name": Param("local", str, choices=("local", "ray")),
    "address": Param(None, str, help="the Ray cluster to join: auto (the one this machine is part of) or "
                                     "ray://HOST:10001; left out: RAY_ADDRESS, else a Ray started on this machine"),
    "num_cpus": Param(1.0, float, min=0.0, exclusive_min=True, help="CPUs each Ray task asks for"),
    "num_gpus": Param(None, float, min=0.0, help="GPUs each Ray task asks for (default: 1 with device cuda, else 0)"),
    "max_retries": Param(3, int, min=0, help="times Ray reruns a task whose worker process or node died"),
}
DATA = {
    "dataset": Param(None, str, help="a registered dataset (leakaudit plugins)"),
    "factory": Param(None, str, help="'package.module:load' returning your own ImageData (instead of dataset)"),
    "image_size": Param(32, int, min=8, max=512),
    "targets": Param(4, int, min=1, max=MAX_TARGETS, help="private images attacked"),
    "target_split": Param("test", str, choices=("test", "train"),
                          help="the split the targets come from: test (never trained on) or train (also trained "
                               "on, as Balunovic et al. 2022 attack the first 100 training images)"),
    "target_order": Param("random", str, choices=("random", "first"),
                          help="a seeded draw of the split, or its first images in the dataset's own order"),
    "batch_size": Param(1, int, min=1, help="images per shared update"),
    "root": Param(None, str),
    "download": Param(False, bool),
    "params": Param({}, dict),
}
MODEL = {"name": Param(None, str, help="a zoo model (leakaudit plugins)"),
         "factory": Param(None, str, help="'package.module:build' returning your own nn.Module (instead of name)"),
         "params": Param({}, dict), "checkpoints": Param([0], list),
         "mode": Param("train", str, choices=("train", "eval"),
                       help="the mode the client's update is computed (and attacked) in: train (BatchNorm batch "
                            "statistics) or eval (running statistics, as Geiping et al.'s and Balunovic et al.'s "
                            "code attack)")}
DEFENSE = {"name": Param(None, str), "params": Param({}, dict), "sweep": Param({}, dict), "label": Param(None, str),
           "chain": Param(None, list, help="defenses applied in order, each {name, params, sweep}"),
           "model": Param(None, dict, help="this entry's own model {name or factory, params} (default: model)"),
           "must_protect": Param(False, bool, help="run --fail-on-leak exits with status 3 when a setting of this "
                                                   "entry leaks")}
SETTING_MODEL = {k: p for k, p in MODEL.items() if k != "checkpoints"}
MEMBER = {"name": Param(type=str), "params": Param({}, dict), "sweep": Param({}, dict)}
ROLES = ("naive", "adaptive")
ATTACK = {"name": Param(type=str), "params": Param({}, dict), "label": Param(None, str),
          "tune": Param(None, dict, help="budgeted hyperparameter search before attacking (evaluator/audit/tuning.py)"),
          "defenses": Param(None, list, help="run only on settings with a defense (or chain member) of these "
                                             "names, or with these labels"),
          "checkpoints": Param(None, list, help="run only at these of model.checkpoints (e.g. a prior weight for the "
                                                "untrained model and another for the trained one)"),
          "role": Param(None, str, choices=ROLES, help="how the report counts it (default: adaptive when the "
                                                       "attack uses what the defense does)")}
UTILITY = {
    "train_steps": Param(200, int, min=0, max=MAX_STEPS, help="SGD steps of utility training under the defense"),
    "batch_size": Param(32, int, min=1),
    "lr": Param(0.1, float, min=0.0, exclusive_min=True),
    "momentum": Param(0.0, float, min=0.0, max=1.0),
    "delta": Param(1e-5, float, min=0.0, max=1.0, exclusive_min=True,
                   help="delta at which epsilon is reported for defenses with a formal guarantee"),
    "train_defended": Param(True, bool, help="train under the defense; false: plain SGD on clean updates, the "
                                             "defense only on the attacked update (Balunovic et al. 2022's "
                                             "setting); accuracy is then the clean model's, and no epsilon"),
}
STATISTICS = ("mean", "ci_bound")
VERDICT = {
    "margin": Param(None, float, min=0.0, help="how far the strongest attack must beat the better guess made "
                                               "without the gradient to leak, in the leakage metric's units "
                                               "(default: the metric's: psnr 1 dB, ssim 0.05, mse 0.01, lpips 0.05)"),
    "statistic": Param("mean", str, choices=STATISTICS, help="what is compared with the threshold: the strongest "
                                                             "attack's mean, or the leaking end of its interval"),
    "utility_margin": Param(0.05, float, min=0.0, max=1.0, help="test accuracy above chance (the majority class's "
                                                                 "share) a usable model needs"),
    "min_accuracy": Param(None, float, min=0.0, max=1.0, help="usable from this test accuracy (instead of chance "
                                                              "plus utility_margin)"),
    "identifiable": Param(0.25, float, min=0.0, max=1.0, nullable=True,
                          help="with one image per update, also leaks when an attack's share of reconstructions "
                               "nearest their own original reaches this, beyond chance (null: by the score alone)"),
    "confidence": Param(0.95, float, min=0.5, max=0.999, help="level of the bootstrap intervals and the "
                                                              "identification test"),
    "bootstrap": Param(2000, int, min=100, max=100_000, help="bootstrap resamples per interval"),
}
THREAT = {"known_labels": Param(False, bool, help="the attacker is given the true labels")}


class ConfigError(Exception):
    """Problems found in an audit file, one line each: '<file>: <key path>: <what is wrong>'."""

    def __init__(self, lines: list[str]):
        lines = [line if len(line) <= MAX_LINE else line[:MAX_LINE - 3] + "..." for line in lines]
        if len(lines) > MAX_PROBLEMS_SHOWN:
            lines = [*lines[:MAX_PROBLEMS_SHOWN], f"... and {len(lines) - MAX_PROBLEMS_SHOWN} more problems"]
        super().__init__("\n".join(lines))
        self.lines = lines


def _call(name: str, params: dict[str, Any]) -> str:
    args = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
    return f"{name}({args})" if args else name


@dataclass(frozen=True)
class DefenseSetting:
    """One point of a defense sweep: one defense, or a chain of them applied in order."""

    members: tuple[tuple[str, dict[str, Any]], ...]
    label: str | None = None
    model: dict[str, Any] | None = None  # the entry's own model section; None: the audit's
    must_protect: bool = field(default=False, compare=False)  # gated by run --fail-on-leak
    #: On an undefended reference: the labels of the attacks that calibrate on it (None on every other setting).
    calibrates: frozenset[str] | None = field(default=None, compare=False)
    #: Added by leakaudit as its model's reference, where the audit file names no undefended setting for it.
    added: bool = field(default=False, compare=False)

    @property
    def name(self) -> str:
        return ">".join(n for n, _ in self.members)

    @property
    def params(self) -> dict[str, Any]:
        if len(self.members) == 1:
            return dict(self.members[0][1])
        return {f"{n}.{k}": v for n, p in self.members for k, v in p.items()}

    @property
    def identity(self) -> str:
        """What the setting is (members, parameters, own model), whatever its label: its random streams
        derive from this, so renaming a label leaves the numbers as they were."""
        own = "" if self.model is None else f"@{_call_model(self.model)}"
        return ">".join(_call(n, p) for n, p in self.members) + own

    @property
    def key(self) -> str:
        """The setting's name in results and reports: its label, else its identity."""
        return self.label or self.identity

    def is_baseline(self, registry: Registry) -> bool:
        """Whether the setting is the undefended reference (every member's defense says ``baseline``)."""
        return all(registry.get("defense", n).baseline for n, _ in self.members)

    def build(self, registry: Registry):
        """The defense object (a ``defenses.chain.Chain`` for several members)."""
        from leakaudit.defenses.chain import Chain

        parts = [registry.get("defense", n)(**p) for n, p in self.members]
        return parts[0] if len(parts) == 1 else Chain(parts)


@dataclass(frozen=True)
class AttackSpec:
    name: str
    params: dict[str, Any]
    label: str
    tune: TuneSpec | None = None
    defenses: tuple[str, ...] | None = None  # None: every setting
    role: str = "naive"  # "adaptive": the attack uses what the defense does
    checkpoints: tuple[int, ...] | None = None  # None: every checkpoint of the model

    @property
    def key(self) -> str:
        return self.label

    @property
    def identity(self) -> str:
        """The attack and its parameters, whatever its label (seeds its tuning draws)."""
        return _call(self.name, self.params)

    def build(self, registry: Registry, params: dict | None = None):
        """The attack object, with ``params`` (a tuned setting) in place of the audit's when given."""
        return registry.get("attack", self.name)(**(self.params if params is None else params))

    def applies_to(self, setting: DefenseSetting) -> bool:
        """Whether the attack runs on this setting: on an undefended reference, when it calibrates there;
        elsewhere, when ``defenses:`` is absent or names one of the setting's members, or its label."""
        if setting.calibrates is not None:
            return self.label in setting.calibrates
        return self.filters_in(setting)

    def filters_in(self, setting: DefenseSetting) -> bool:
        """Whether ``defenses:`` lets the attack run on this setting (absent, or naming a member or its label)."""
        return (self.defenses is None or setting.label in self.defenses
                or any(n in self.defenses for n, _ in setting.members))

    def runs_at(self, checkpoint: int) -> bool:
        """Whether the attack runs at this training step (``checkpoints:`` lists it, or is absent)."""
        return self.checkpoints is None or checkpoint in self.checkpoints


@dataclass
class Audit:
    """A validated audit file with defaults filled in and sweeps expanded."""

    path: Path
    text: str
    name: str
    seed: int
    device: str
    workers: int | None  # None: auto, decided from the pending work (runner.auto_workers)
    plugins_dirs: list[Path]
    data: dict[str, Any]
    model: dict[str, Any]
    settings: list[DefenseSetting]
    attacks: list[AttackSpec]
    utility: dict[str, Any]
    metrics: list[str]
    threat: dict[str, Any]
    protocol: Protocol = FEDSGD
    registry: Registry = field(repr=False, default=None)
    leakage_metric: str = "psnr"
    max_problems: int | None = None  # None: auto
    verdict: dict[str, Any] = field(default_factory=lambda: {k: p.default for k, p in VERDICT.items()})
    deterministic: bool = True
    executor: dict[str, Any] = field(default_factory=lambda: {k: p.default for k, p in EXECUTOR.items()})
    architecture: str | bool = "auto"  # the report's architecture analysis: auto, True or False
    live: dict[str, Any] | None = None  # a LeakMonitor's run: its monitor.json (None: an audit file's run)

    @property
    def checkpoints(self) -> list[int]:
        return self.model["checkpoints"]

    @property
    def num_batches(self) -> int:
        return self.data["targets"] // self.data["batch_size"]

    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def reference_of(self, setting: DefenseSetting) -> DefenseSetting | None:
        """The undefended reference that calibrates ``setting``'s verdicts: its model's (``with_references``)."""
        own = _call_model(setting.model)
        return next((s for s in self.settings if s.calibrates is not None and _call_model(s.model) == own), None)


def _section(value: Any, spec: dict[str, Param], path: str, problems: list[str]) -> dict[str, Any]:
    """Check a mapping against its spec and return it with defaults filled."""
    if not isinstance(value, dict):
        problems.append(f"{path}: expected a mapping, got {type(value).__name__}")
        return {k: p.default for k, p in spec.items() if not p.required}
    problems.extend(check_params(spec, value, path))
    out = {k: p.default for k, p in spec.items() if not p.required}
    out.update({k: v for k, v in value.items() if k in spec and spec[k].problem(v) is None})
    return out


def _checked_section(value: Any, spec: dict[str, Param], path: str, problems: list[str]) -> tuple[dict[str, Any], bool]:
    """``_section``, and whether it found nothing wrong (else the checks built on it are skipped: one line each)."""
    found = len(problems)
    out = _section(value, spec, path, problems)
    return out, len(problems) == found


def _strip(path: str) -> str:
    return path[1:] if path.startswith(".") else path


class AuditLoader(yaml.SafeLoader):
    """YAML 1.1's safe loader that also reads ``1e-5`` as a float, as YAML 1.2 and Python do, and refuses a
    key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
                seen[key] = key_node.start_mark.line
            except TypeError:  # an unhashable key: the constructor reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first at line {first + 1}); keep one", key_node.start_mark)
        return super().construct_mapping(node, deep)


AuditLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _expanded_size(value: Any, seen: dict[int, int]) -> int:
    """Values in ``value`` with every alias expanded (aliases share objects: counted once per object, fast)."""
    if id(value) in seen:
        return seen[id(value)]
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    seen[id(value)] = 1 + sum(_expanded_size(c, seen) for c in children)
    return seen[id(value)]


def read_yaml(path: Path) -> tuple[str, Any]:
    """The file's text and parsed content; a ConfigError when it is missing, too large, not text or not YAML."""
    if path.is_dir():
        raise ConfigError([f"{path}: is a folder; give the audit's YAML file"])
    if path.exists() and not path.is_file():
        raise ConfigError([f"{path}: not a regular file (a pipe or device); give the audit's YAML file"])
    if not path.is_file():
        raise ConfigError([f"{path}: file not found"])
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError([f"{path}: {size} bytes; an audit file is at most {MAX_FILE_BYTES} bytes"])
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not a text file (byte {exc.start} is not UTF-8); give the audit's YAML file"]) from None
    return text, parse_yaml(path, text)


def parse_yaml(path: Path, text: str) -> Any:
    """An audit file's contents parsed; a ConfigError, naming ``path``, when they are not YAML."""
    try:
        raw = yaml.load(text, Loader=AuditLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else f"character {getattr(exc, 'position', '?')}"
        why = " ".join(str(getattr(exc, "problem", None) or getattr(exc, "reason", None) or exc).split())
        raise ConfigError([f"{path}: {where}: not valid YAML: {why}"]) from None
    except RecursionError:
        raise ConfigError([f"{path}: nested too deeply to be an audit file"]) from None
    if _expanded_size(raw, {}) > MAX_YAML_VALUES:
        raise ConfigError([f"{path}: its aliases expand to more than {MAX_YAML_VALUES} values; "
                           "an audit file needs far fewer"])
    return raw


TOP_NEEDS = "name, data, model, defenses and attacks (see configs/quickstart.yaml)"


def load_audit(path: str | Path, plugins_dirs: list[str | Path] = (), registry: Registry | None = None,
               text: str | None = None, import_user_code: bool = True) -> Audit:
    """Read, validate and expand an audit file (``text``: its contents, where the file is elsewhere, as on a
    Ray worker); raise ConfigError listing every problem. ``import_user_code=False`` finds the modules that
    ``factory:`` and ``protocol.function`` name without importing them (``leakaudit validate``)."""
    token = IMPORT_USER_CODE.set(import_user_code)
    try:
        return _load_audit(Path(path), plugins_dirs, registry, text)
    finally:
        IMPORT_USER_CODE.reset(token)


def _load_audit(path: Path, plugins_dirs, registry: Registry | None, text: str | None) -> Audit:
    """``load_audit``'s work."""
    text, raw = read_yaml(path) if text is None else (text, parse_yaml(path, text))
    if raw is None:
        raise ConfigError([f"{path}: the file is empty; an audit needs {TOP_NEEDS}"])
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: the file holds a {type(raw).__name__}; an audit is a mapping of {TOP_NEEDS}"])
    problems: list[str] = []
    top = _section(raw, TOP, "", problems)
    _importable_beside(path)
    dirs = [Path(d).resolve() for d in plugins_dirs]
    if top.get("plugins_dir") and (path.parent / top["plugins_dir"]).resolve() not in dirs:
        dirs.append((path.parent / top["plugins_dir"]).resolve())
    if registry is None:
        try:
            registry = load_registry(dirs)
        except PluginError as exc:
            raise ConfigError([f"{path}: plugins_dir: {exc}" if top.get("plugins_dir") else f"{path}: {exc}"]) from None
    reported = {k for k, p in TOP.items() if (k in raw and p.problem(raw[k])) or (p.required and k not in raw)}

    def into(*keys: str) -> list[str]:
        """Where a section's problems go: nowhere when the section itself was already reported (one line each)."""
        return [] if reported.intersection(keys) else problems

    data, data_ok = _checked_section(top.get("data", {}), DATA, "data", into("data"))
    model, model_ok = _checked_section(top.get("model", {}), MODEL, "model", into("model"))
    utility = _section(top.get("utility", {}), UTILITY, "utility", problems)
    threat = _section(top.get("threat", {}), THREAT, "threat", problems)
    verdict = _section(top.get("verdict", {}), VERDICT, "verdict", into("verdict"))
    _check_data(data, registry, into("data") if data_ok else [])
    _check_model(model, registry, into("model") if model_ok else [])
    protocol = _check_protocol(top.get("protocol", "fedsgd"), data, into("protocol", "data"))
    settings = expand_defenses(top.get("defenses"), registry, into("defenses"), protocol)
    attacks = check_attacks(top.get("attacks"), registry, into("attacks"), model["checkpoints"] if model_ok else None)
    _check_attack_scope(attacks, settings, registry, into("attacks", "defenses"))
    settings = with_references(settings, attacks, registry)
    problems += [f"defenses: the label {s.key!r} is the key of the undefended reference leakaudit adds to calibrate "
                 "the verdicts; choose another label" for s in settings if s.added
                 and any(t.key == s.key for t in settings if t is not s)]
    metrics = check_metrics(top.get("metrics", DEFAULT_METRICS), registry, into("metrics", "data"), data["image_size"])
    leakage = _check_leakage_metric(top.get("leakage_metric"), metrics, registry, into("leakage_metric", "metrics"))
    device = _check_device(top.get("device", "auto"), problems)
    workers = top.get("workers") or (torch.cuda.device_count() if device == "cuda" else None)
    max_problems = _check_max_problems(top.get("max_problems", "auto"), problems)
    executor = check_executor(top.get("executor", "local"), device, problems)
    if problems:
        raise ConfigError([f"{path}: {_strip(p)}" for p in problems])
    return Audit(path, text, top["name"], top["seed"], device, workers, dirs, data, model, settings,
                 attacks, utility, metrics, threat, protocol, registry, leakage, max_problems, verdict,
                 top["deterministic"], executor, architecture=top["architecture"])


def monitor_audit(described: dict[str, Any], path: Path, plugins_dirs: list[str | Path] = (),
                  registry: Registry | None = None) -> Audit:
    """The audit a LeakMonitor's run folder stands for, from its ``monitor.json``: the live training's attacked
    steps as checkpoints and one batch per step, so that the report and ``leakaudit report`` read the folder
    like an audit file's. Raises ConfigError, one line per problem, prefixed with ``path``."""
    problems: list[str] = []
    dirs = [Path(d).resolve() for d in plugins_dirs]
    registry = registry or load_registry(dirs)
    rounds = described.get("rounds") or {}  # federated rounds: the protocol and images of the last audited one
    last = rounds[max(rounds, key=int)] if rounds else {}
    batch = last.get("images", described["batch_size"])
    data = {k: p.default for k, p in DATA.items() if not p.required} | {
        "dataset": described["data"], "image_size": described["image_size"], "targets": batch, "batch_size": batch,
        "target_split": "train", "target_order": "first"}
    model = {k: p.default for k, p in MODEL.items() if not p.required} | {
        "name": described["model"], "checkpoints": sorted(described["steps"]), "mode": described["mode"]}
    name = described.get("protocol", "fedsgd")
    protocol = _check_protocol({"name": name, **{k: v for k, v in last.items() if k in getattr(
        PROTOCOLS.get(name), "params", {})}}, data, problems)
    settings = expand_defenses([described["defense"]], registry, problems, protocol)
    attacks = check_attacks(described["attacks"], registry, problems, None)
    settings = with_references(settings, attacks, registry)
    metrics = check_metrics(described["metrics"], registry, problems, described["image_size"])
    leakage = _check_leakage_metric(None, metrics, registry, problems)
    if problems:
        raise ConfigError([f"{path}: {_strip(p)}" for p in problems])
    utility = {k: p.default for k, p in UTILITY.items()} | {"train_steps": 0, "delta": described["delta"]}
    verdict = {k: p.default for k, p in VERDICT.items()}
    return Audit(path, yaml.safe_dump(described, sort_keys=True), described["name"], described["seed"],
                 described["device"], 1, dirs, data, model, settings, attacks, utility, metrics,
                 {"known_labels": described["known_labels"]}, protocol, registry, leakage, None, verdict, True,
                 live=described)


def _importable_beside(path: Path) -> None:
    """Let factories and step functions name modules that sit beside the audit file."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)


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


def _check_data(data: dict, registry: Registry, problems: list[str]) -> None:
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


def _check_model(model: dict, registry: Registry, problems: list[str]) -> None:
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
    if source == "factory" or ":" in name:
        _check_factory(model, source, f"{where}.{source}", problems)
        model["name"] = model[source]  # a factory path is the model's name in reports
        return
    if not isinstance(name, str) or name not in registry.entries["model"]:
        problems.append(f"{where}.name: {name!r} is not a registered model or a 'package.module:factory'"
                        f"{did_you_mean(name, registry.names('model'))}; choices: {_choices(registry, 'model')}")
        return
    spec: ModelSpec = registry.get("model", name)
    problems.extend(check_params(spec.params, model.get("params", {}), f"{where}.params"))


def _items(value: Any, what: str, problems: list[str]) -> list[tuple[str, dict]]:
    if value is None:
        problems.append(f"{what}: required, a list of {{name: ...}} entries")
        return []
    if not isinstance(value, list) or not value:
        problems.append(f"{what}: expected a non-empty list, got {value!r}")
        return []
    return [(f"{what}[{i}]", item) for i, item in enumerate(value)]


def expand_defenses(value: Any, registry: Registry, problems: list[str],
                     protocol: Protocol = FEDSGD) -> list[DefenseSetting]:
    settings: list[DefenseSetting] = []
    for where, item in _items(value, "defenses", problems):
        item, ok = _checked_section(item, DEFENSE, where, problems)
        if not ok:
            continue
        if item.get("chain") is not None:
            if item.get("name") or item["params"] or item["sweep"]:
                problems.append(f"{where}: give either name (with params, sweep) or chain, not both")
                continue
            if not item["chain"]:
                problems.append(f"{where}.chain: an empty chain; list the defenses applied in order, e.g. "
                                "[{name: clip, params: {max_norm: 1.0}}, {name: gaussian, params: {sigma: 0.1}}]")
                continue
            options = [_member_options(_section(m, MEMBER, f"{where}.chain[{i}]", problems), registry,
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
            own_model = _section(item["model"], SETTING_MODEL, f"{where}.model", problems)
            found = len(problems)
            _check_architecture(own_model, registry, f"{where}.model", problems)
            if len(problems) > found:
                continue
        combos = list(itertools.product(*options))
        for members in combos:
            setting = DefenseSetting(tuple(members), item["label"] if len(combos) == 1 else None, own_model,
                                     item["must_protect"])
            try:
                why = setting.build(registry).unsupported(protocol)
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


def with_references(settings: list[DefenseSetting], attacks: list[AttackSpec],
                    registry: Registry) -> list[DefenseSetting]:
    """``settings`` with an undefended reference for each model they run on, which calibrates the verdicts:
    the audit's own undefended setting of that model, else one added at the end (marked ``added``).

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
    models = list({_call_model(s.model): s.model for s in settings}.items())
    for name, own in models:
        mine = [s for s in settings if _call_model(s.model) == name]
        given = next((s for s in mine if s.is_baseline(registry)), None)
        labels = frozenset(a.label for a in attacks if (given is not None and a.filters_in(given)) or (
            any(a.filters_in(s) for s in mine) and _calibrates(a.build(registry), reference)))
        if given is not None:
            settings = [dataclasses.replace(s, calibrates=labels) if s is given else s for s in settings]
        elif labels:
            out.append(DefenseSetting(((baseline.name, {}),), None, own, False, labels, True))
    return settings + out


def _calibrates(attack: Any, reference: Any) -> bool:
    """Whether a (filtered) attack can also run on the undefended update."""
    return not attack.needs_defense and attack.unsupported_defense(reference) is None


def _call_model(model: dict[str, Any] | None) -> str:
    """A setting's own model as text ("" for the audit's): settings of one model share a reference."""
    return "" if model is None else _call(model["name"], model.get("params", {}))


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
    return [(name, {**item["params"], **dict(zip(keys, combo))}) for combo in itertools.product(*(sweep[k] for k in keys))]


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


def check_attacks(value: Any, registry: Registry, problems: list[str],
                   model_checkpoints: list[int] | None) -> list[AttackSpec]:
    """The attack entries; ``model_checkpoints`` is None where the model section was already reported."""
    specs: list[AttackSpec] = []
    for where, item in _items(value, "attacks", problems):
        item, ok = _checked_section(item, ATTACK, where, problems)
        if not ok:
            continue
        name = item.get("name")
        cls = None if name is None else _lookup(registry, "attack", name, f"{where}.name", problems)
        if cls is None:
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
            problems.append(f"{where}.params: {_origin(registry, 'attack', name)} raised {one_line(exc)}")
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
    """The defense names or setting labels an attack is restricted to (checked in ``_check_attack_scope``)."""
    if value is None:
        return None
    if not value or not all(isinstance(n, str) for n in value):
        problems.append(f"{where}: expected a non-empty list of defense names or setting labels, got {value!r}")
        return None
    return tuple(value)


def _check_attack_scope(attacks: list[AttackSpec], settings: list[DefenseSetting], registry: Registry,
                        problems: list[str]) -> None:
    """Each name in an attack's ``defenses:`` is a defense or a setting label, and the attack runs somewhere."""
    labels = sorted(s.label for s in settings if s.label)
    for i, a in enumerate(attacks):
        unknown = [n for n in a.defenses or () if n not in registry.entries["defense"] and n not in labels]
        for n in unknown:
            choices = [*registry.names("defense"), *labels]
            problems.append(f"attacks[{i}].defenses: {n!r} is not a registered defense or a setting label"
                            f"{did_you_mean(n, choices)}; choices: {', '.join(choices)}")
        if not unknown and settings and not any(a.applies_to(s) for s in settings):
            problems.append(f"attacks[{i}].defenses: no setting of this audit uses "
                            f"{', '.join(a.defenses)}; defenses here: {', '.join(sorted({s.name for s in settings}))}")


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


def _check_leakage_metric(value: str | None, metrics: list[str], registry: Registry, problems: list[str]) -> str:
    """The metric that ranks attacks: ``leakage_metric:``, else psnr when measured, else the first metric."""
    if value is None:
        return "psnr" if "psnr" in metrics or not metrics else metrics[0]
    if value not in metrics:
        problems.append(f"leakage_metric: {value!r} is not one of this audit's metrics; choices: {', '.join(metrics)}")
    return value


def check_executor(value: Any, device: str, problems: list[str]) -> dict[str, Any]:
    """``executor:`` as a full mapping (a name alone takes the defaults); Ray must be installed to be named."""
    value = {"name": value} if isinstance(value, str) else value if isinstance(value, dict) else {}
    found = check_params(EXECUTOR, value, "executor")
    problems.extend(found)
    section = {k: p.default for k, p in EXECUTOR.items()} | ({} if found else value)
    if section["num_gpus"] is None:
        section["num_gpus"] = 1.0 if device == "cuda" else 0.0
    if section["name"] == "ray" and importlib.util.find_spec("ray") is None:
        problems.append("executor: ray needs Ray, which is not installed: pip install 'leakaudit[ray]'")
    return section


def _check_protocol(value: Any, data: dict, problems: list[str]) -> Protocol:
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
    b = section.get("local_batch_size")
    if b is not None and b > data["batch_size"]:
        problems.append(f"protocol.local_batch_size: {b} is larger than data.batch_size {data['batch_size']} "
                        "(the images each client holds)")
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


def _check_max_problems(value: Any, problems: list[str]) -> int | None:
    """``max_problems``: 'auto' (None) or a whole number of at least 1."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(f"max_problems: {value!r} is neither 'auto' nor a whole number >= 1; choices: auto, 1, 2, ...")
        return None
    return value


def _check_device(device: str, problems: list[str]) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        problems.append("device: 'cuda' but no CUDA device is available here; choices: auto, cpu, cuda")
    return device
