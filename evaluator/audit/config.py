"""Audit files: YAML loaded and validated in full before any work, one line per problem."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from leakaudit.evaluator.audit.auto import AUTO, choose_attacks
from leakaudit.evaluator.audit.budget import check_budget
from leakaudit.evaluator.audit.checks import (
    IMPORT_USER_CODE,
    check_attack_scope,
    check_attacks,
    check_compile,
    check_data,
    check_device,
    check_executor,
    check_leakage_metric,
    check_max_problems,
    check_metrics,
    check_modality,
    check_model,
    check_precision,
    check_protocol,
    checked_section,
    data_modality,
    expand_defenses,
    fitting_metrics,
    section,
    with_references,
)
from leakaudit.evaluator.audit.specs import (DATA, DEFAULT_METRICS, DEFAULT_TEXT_METRICS, MODEL, THREAT, TOP, TOP_NEEDS,
                                             UTILITY, VERDICT)
from leakaudit.evaluator.audit.types import (
    AUDIT_FOLDER,
    Audit,
    ConfigError,
    DataSection,
    ModelSection,
    ThreatSection,
    UtilitySection,
    VerdictSection,
)
from leakaudit.evaluator.audit.yamlfile import parse_yaml, read_yaml
from leakaudit.plugins.manager import Registry, load_registry
from leakaudit.plugins.protocol import PROTOCOLS
from leakaudit.plugins.spec import PluginError


def _strip_dot(path: str) -> str:
    """A problem's key path without the dot a top-level key starts with."""
    return path[1:] if path.startswith(".") else path


def load_audit(path: str | Path, plugins_dirs: Sequence[str | Path] = (), registry: Registry | None = None,
               text: str | None = None, import_user_code: bool = True) -> Audit:
    """Read, validate and expand an audit file.

    Args:
        path: the audit's YAML file.
        plugins_dirs: drop-in folders of plugin modules, loaded beside the installed plugins.
        registry: the plugins to check names against (default: loaded from ``plugins_dirs`` and entry points).
        text: the file's contents, where the file itself is elsewhere (as on a Ray worker).
        import_user_code: False finds the modules that ``factory:`` and ``protocol.function`` name without
            importing them (``leakaudit validate``).

    Returns:
        The audit: every section typed, every sweep expanded into its settings, every name resolved.

    Raises:
        ConfigError: every problem of the file at once, one line each naming the file, the key and the choices,
            before any work starts.

    Example:
        audit = leakaudit.load_audit("configs/quickstart.yaml")
        print([setting.key for setting in audit.settings])
    """
    token = IMPORT_USER_CODE.set(import_user_code)
    beside = AUDIT_FOLDER.set(Path(path).resolve().parent)
    try:
        return _load_audit(Path(path), plugins_dirs, registry, text)
    finally:
        AUDIT_FOLDER.reset(beside)
        IMPORT_USER_CODE.reset(token)


def _load_audit(path: Path, plugins_dirs, registry: Registry | None, text: str | None) -> Audit:
    """``load_audit``'s work."""
    text, raw = read_yaml(path) if text is None else (text, parse_yaml(path, text))
    if raw is None:
        raise ConfigError([f"{path}: the file is empty; an audit needs {TOP_NEEDS}"])
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: the file holds a {type(raw).__name__}; an audit is a mapping of {TOP_NEEDS}"])
    problems: list[str] = []
    top = section(raw, TOP, "", problems)
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

    data, data_ok = checked_section(top.get("data", {}), DATA, "data", into("data"))
    model, model_ok = checked_section(top.get("model", {}), MODEL, "model", into("model"))
    utility = section(top.get("utility", {}), UTILITY, "utility", problems)
    threat = section(top.get("threat", {}), THREAT, "threat", problems)
    verdict = section(top.get("verdict", {}), VERDICT, "verdict", into("verdict"))
    check_data(data, registry, into("data") if data_ok else [])
    check_model(model, registry, into("model") if model_ok else [])
    protocol = check_protocol(top.get("protocol", "fedsgd"), data, into("protocol", "data"))
    frontiers: list = []
    settings = expand_defenses(top.get("defenses"), registry, into("defenses"), protocol, data if data_ok else None,
                               frontiers)
    value = top.get("attacks", AUTO)
    auto = value == AUTO
    if isinstance(value, str) and not auto:
        into("attacks").append(f"attacks: expected auto or a list of {{name: ...}} entries, got {value!r}")
    attacks = [] if isinstance(value, str) else check_attacks(value, registry, into("attacks"),
                                                               model["checkpoints"] if model_ok else None)
    check_attack_scope(attacks, settings, registry, into("attacks", "defenses"))
    modality = data_modality(data, registry) if data_ok else "image"
    image_size = data["image_size"] if modality == "image" else None
    notes: tuple[str, ...] = ()
    if "metrics" in raw:
        wanted = top["metrics"]
    elif modality == "image" and data_ok:  # the defaults that fit the images, a note for each left out
        wanted, notes = fitting_metrics(DEFAULT_METRICS, registry, data["image_size"])
    else:
        wanted = DEFAULT_METRICS if modality == "image" else DEFAULT_TEXT_METRICS  # the data's examples' defaults
    metrics = check_metrics(wanted, registry, into("metrics", "data"), image_size)
    check_modality(modality, data, model, settings, attacks, metrics, registry,
                   into("data", "model", "defenses", "attacks", "metrics"))
    leakage = check_leakage_metric(top.get("leakage_metric"), metrics, registry, into("leakage_metric", "metrics"))
    device = check_device(top.get("device", "auto"), problems)
    check_compile(top.get("compile"), device, problems)
    check_precision(top.get("precision"), device, problems)
    workers = top.get("workers") or (torch.cuda.device_count() if device == "cuda" else None)
    max_problems = check_max_problems(top.get("max_problems", "auto"), problems)
    executor = check_executor(top.get("executor", "local"), device, problems)
    budget = check_budget(top.get("budget"), problems)
    if problems:
        raise ConfigError([f"{path}: {_strip_dot(p)}" for p in problems])
    audit = Audit(path=path, text=text, name=top["name"], seed=top["seed"], device=device, workers=workers,
                  plugins_dirs=dirs, data=DataSection(**data), model=ModelSection(**model), settings=settings,
                  attacks=attacks, utility=UtilitySection(**utility), metrics=metrics, threat=ThreatSection(**threat),
                  protocol=protocol, registry=registry, leakage_metric=leakage, max_problems=max_problems,
                  verdict=VerdictSection(**verdict), deterministic=top["deterministic"], compile=top["compile"],
                  precision=top["precision"],
                  executor=executor, architecture=top["architecture"], frontiers=frontiers, budget=budget,
                  notes=notes)
    if auto:
        audit.attacks, audit.attack_choice = choose_attacks(audit, IMPORT_USER_CODE.get())
    audit.settings = with_references(settings, audit.attacks, registry)
    taken = [f"{path}: defenses: the label {s.key!r} is the key of the undefended reference leakaudit adds to "
             "calibrate the verdicts; choose another label" for s in audit.settings if s.added
             and any(t.key == s.key for t in audit.settings if t is not s)]
    if taken:
        raise ConfigError(taken)
    return audit


def monitor_audit(described: dict[str, Any], path: Path, plugins_dirs: Sequence[str | Path] = (),
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
    protocol = check_protocol({"name": name, **{k: v for k, v in last.items() if k in getattr(
        PROTOCOLS.get(name), "params", {})}}, data, problems)
    settings = expand_defenses([described["defense"]], registry, problems, protocol)
    attacks = check_attacks(described["attacks"], registry, problems, None)
    settings = with_references(settings, attacks, registry)
    metrics = check_metrics(described["metrics"], registry, problems, described["image_size"])
    leakage = check_leakage_metric(described.get("leakage_metric"), metrics, registry, problems)
    verdict = section(described.get("verdict") or {}, VERDICT, "verdict", problems)
    if problems:
        raise ConfigError([f"{path}: {_strip_dot(p)}" for p in problems])
    utility = {k: p.default for k, p in UTILITY.items()} | {"train_steps": 0, "delta": described["delta"]}
    return Audit(path=path, text=yaml.safe_dump(described, sort_keys=True), name=described["name"],
                 seed=described["seed"], device=described["device"], workers=1, plugins_dirs=dirs,
                 data=DataSection(**data), model=ModelSection(**model), settings=settings, attacks=attacks,
                 utility=UtilitySection(**utility), metrics=metrics,
                 threat=ThreatSection(known_labels=described["known_labels"]), protocol=protocol, registry=registry,
                 leakage_metric=leakage, max_problems=None, verdict=VerdictSection(**verdict), deterministic=True,
                 live=described)


def _importable_beside(path: Path) -> None:
    """Let factories and step functions name modules that sit beside the audit file."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)


