"""The validated audit as the engine reads it: its defense settings, its attacks, the ``Audit`` itself, and
the error that lists an audit file's problems."""
from __future__ import annotations

import contextvars
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from leakaudit.evaluator.audit.specs import DEFAULT_LEAKAGE_METRIC, MAX_LINE, MAX_PROBLEMS_SHOWN
from leakaudit.evaluator.audit.tuning import TuneSpec
from leakaudit.plugins.manager import Registry
from leakaudit.plugins.protocol import FEDSGD, Protocol


#: The folder of the audit file being loaded: the settings made meanwhile read their files (``Param.file``) there.
AUDIT_FOLDER: contextvars.ContextVar[Path | None] = contextvars.ContextVar("leakaudit_audit_folder", default=None)


class ConfigError(Exception):
    """Problems found in an audit file, one line each: '<file>: <key path>: <what is wrong>'."""

    def __init__(self, lines: list[str]):
        lines = [line if len(line) <= MAX_LINE else line[:MAX_LINE - 3] + "..." for line in lines]
        if len(lines) > MAX_PROBLEMS_SHOWN:
            lines = [*lines[:MAX_PROBLEMS_SHOWN], f"... and {len(lines) - MAX_PROBLEMS_SHOWN} more problems"]
        super().__init__("\n".join(lines))
        self.lines = lines


def value_text(value: Any) -> str:
    """A parameter's value as people read it (floats in their shortest form: ``0.1``, ``1e-05``)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def params_text(params: dict) -> str:
    """A setting's parameters as people read them: ``sigma=0.1, clip=1``."""
    return ", ".join(f"{k}={value_text(v)}" for k, v in params.items())


def call_label(name: str, params: dict[str, Any]) -> str:
    args = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
    return f"{name}({args})" if args else name



# --- the audit file's sections, typed: fields and defaults are the Param tables' (tests/test_config.py checks) ---

def _copy(value: Any) -> Any:
    return field(default_factory=lambda: type(value)(value))


@dataclass(frozen=True)
class DataSection:
    """``data:``: where the private images come from and how many are attacked, in updates of how many."""

    dataset: str | None = None
    factory: str | None = None
    image_size: int = 32
    targets: int = 4
    target_split: str = "test"
    target_order: str = "random"
    batch_size: int = 1
    root: str | None = None
    download: bool = False
    params: dict[str, Any] = _copy({})


@dataclass(frozen=True)
class ModelSection:
    """``model:`` (or a defense entry's own ``model:``, whose ``checkpoints`` are the audit's): the attacked network."""

    name: str | None = None
    factory: str | None = None
    params: dict[str, Any] = _copy({})
    checkpoints: list[int] = _copy([0])
    mode: str = "train"


@dataclass(frozen=True)
class UtilitySection:
    """``utility:``: the training under each defense whose test accuracy is the defense's cost."""

    train_steps: int = 200
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.0
    delta: float = 1e-5
    max_drop: float = 0.05
    train_defended: bool = True


@dataclass(frozen=True)
class ThreatSection:
    """``threat:``: what the attacker is given besides the update and the model."""

    known_labels: bool = False


@dataclass(frozen=True)
class VerdictSection:
    """``verdict:``: the thresholds the report judges by."""

    margin: float | None = None
    statistic: str = "mean"
    utility_margin: float = 0.05
    min_accuracy: float | None = None
    identifiable: float | None = 0.25
    confidence: float = 0.95
    bootstrap: int = 2000


@dataclass(frozen=True)
class ExecutorSection:
    """``executor:``: where the jobs run, this machine's processes or a Ray cluster's tasks."""

    name: str = "local"
    address: str | None = None
    num_cpus: float = 1.0
    num_gpus: float | None = None
    max_retries: int = 3


def as_dict(section: Any) -> dict[str, Any]:
    """A section as the mapping it was written as (for summary.json, and for plugins that read a section)."""
    return dataclasses.asdict(section)


@dataclass(frozen=True)
class DefenseSetting:
    """One point of a defense sweep: one defense, or a chain of them applied in order."""

    members: tuple[tuple[str, dict[str, Any]], ...]
    label: str | None = None
    model: ModelSection | None = None  # the entry's own model section; None: the audit's
    must_protect: bool = field(default=False, compare=False)  # gated by run --fail-on-leak
    #: On an undefended reference: the labels of the attacks that calibrate on it (None on every other setting).
    calibrates: frozenset[str] | None = field(default=None, compare=False)
    #: Added by leakaudit as its model's reference, where the audit file names no undefended setting for it.
    added: bool = field(default=False, compare=False)
    #: Secure aggregation over this many clients (``clients:`` of the entry); None: the audit's protocol.clients.
    clients: int | None = None
    #: The audit file's folder, where a relative file parameter (``Param.file``) is read; None: the working directory.
    folder: Path | None = field(default_factory=AUDIT_FOLDER.get, compare=False)

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
        own = "" if self.model is None else f"@{model_label(self.model)}"
        crowd = "" if self.clients is None else f"[{self.clients} client{'s' if self.clients > 1 else ''}]"
        return ">".join(call_label(n, p) for n, p in self.members) + own + crowd

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

        parts = [registry.get("defense", n)(**self.located(registry.get("defense", n).params, p))
                 for n, p in self.members]
        return parts[0] if len(parts) == 1 else Chain(parts)

    def located(self, declared: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with each relative file parameter (``Param.file``) made a path beside the audit file; the
        setting's key keeps the value as written, so no machine's folder enters its name or its seeds."""
        return {k: str(self.folder / v) if self.folder is not None and k in declared and declared[k].file
                and isinstance(v, str) and not Path(v).is_absolute() else v for k, v in params.items()}


@dataclass(frozen=True)
class FrontierSpec:
    """A ``frontier:`` entry: one defense whose monotone knob is bisected, in log space on the verdict, for the
    weakest setting that protects; every probe is a setting judged like any other."""

    where: str  # the entry, for messages: "defenses[1]"
    name: str
    params: dict[str, Any]  # the defense's other parameters, fixed
    knob: str
    low: float
    high: float
    tolerance: float
    probes: int
    protects: str  # "higher": larger values protect more; "lower"
    integer: bool
    model: ModelSection | None = None
    clients: int | None = None
    folder: Path | None = field(default_factory=AUDIT_FOLDER.get, compare=False)  # as DefenseSetting.folder

    def setting(self, value: float) -> DefenseSetting:
        """The setting of the defense at one value of the knob (named by its identity: the search names it)."""
        return DefenseSetting(((self.name, {**self.params, self.knob: value}),), None, self.model, clients=self.clients,
                              folder=self.folder)

    @property
    def strong(self) -> float:
        """The end of the range that protects most."""
        return self.high if self.protects == "higher" else self.low

    @property
    def weak(self) -> float:
        return self.low if self.protects == "higher" else self.high


@dataclass(frozen=True)
class AttackSpec:
    name: str
    params: dict[str, Any]
    label: str
    tune: TuneSpec | None = None
    defenses: tuple[str, ...] | None = None  # None: every setting
    role: str = "naive"  # "adaptive": the attack uses what the defense does
    checkpoints: tuple[int, ...] | None = None  # None: every checkpoint of the model
    #: Chosen by ``attacks: auto`` for these settings only (their identities), where it applies; None: all.
    chosen_for: frozenset[str] | None = None

    @property
    def key(self) -> str:
        return self.label

    @property
    def identity(self) -> str:
        """The attack and its parameters, whatever its label (seeds its tuning draws)."""
        return call_label(self.name, self.params)

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
        """Whether ``defenses:`` lets the attack run on this setting (absent, or naming a member or its label),
        and ``attacks: auto`` chose it there."""
        if self.chosen_for is not None and setting.identity not in self.chosen_for:
            return False
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
    data: DataSection
    model: ModelSection
    settings: list[DefenseSetting]
    attacks: list[AttackSpec]
    utility: UtilitySection
    metrics: list[str]
    threat: ThreatSection
    protocol: Protocol = FEDSGD
    registry: Registry = field(repr=False, kw_only=True)
    leakage_metric: str = DEFAULT_LEAKAGE_METRIC
    max_problems: int | None = None  # None: auto
    verdict: VerdictSection = field(default_factory=VerdictSection)
    deterministic: bool = True
    compile: bool = False  # the attacks' vectorised steps through torch.compile
    precision: str = "float32"  # bfloat16: the vectorised steps' model passes under autocast
    executor: ExecutorSection = field(default_factory=ExecutorSection)
    architecture: str | bool = "auto"  # the report's architecture analysis: auto, True or False
    live: dict[str, Any] | None = None  # a LeakMonitor's run: its monitor.json (None: an audit file's run)
    #: ``attacks: auto``'s account of its choice, one line per registered attack (empty: the file lists them).
    attack_choice: tuple[str, ...] = ()
    #: What the loader decided where the file is silent, one line each (a default metric left out at a small
    #: image_size); validate and run print them.
    notes: tuple[str, ...] = ()
    #: ``frontier:`` entries: each one's ends are settings from the start, its bisection adds the rest.
    frontiers: list[FrontierSpec] = field(default_factory=list)
    #: Where the targets start in the target split's seeded order: 0, or past the searched targets where a
    #: frontier's choice is confirmed on fresh ones (``on_fresh_targets``; not an audit-file key).
    target_offset: int = 0
    #: ``budget:`` in seconds (None: none), and the plan that fits the attacks into it (run/estimate.py's).
    budget: float | None = None
    budget_plan: dict[str, Any] | None = None
    #: The attacks the budget's plan left out, as the file lists them (a verdict they could change stays open).
    budget_left_out: list[AttackSpec] = field(default_factory=list)

    def add_probe(self, spec: FrontierSpec, value: float) -> DefenseSetting:
        """The setting of a frontier search at ``value``, added to the audit (with the attacks that ``attacks:
        auto`` chose for its ends) where it is not there yet."""
        setting = spec.setting(value)
        if any(s.key == setting.key for s in self.settings):
            return next(s for s in self.settings if s.key == setting.key)
        end = spec.setting(spec.strong).identity
        self.attacks = [dataclasses.replace(a, chosen_for=a.chosen_for | {setting.identity})
                        if a.chosen_for is not None and end in a.chosen_for else a for a in self.attacks]
        self.settings.append(setting)
        return setting

    def on_fresh_targets(self, keys: Sequence[str]) -> Audit:
        """This audit narrowed to the settings ``keys`` and their undefended references, attacking as many targets
        again, the next ones of the seeded order: a frontier's choice confirmed on targets its search never saw."""
        chosen = [s for s in self.settings if s.key in keys]
        keep = {s.key for s in chosen} | {r.key for s in chosen if (r := self.reference_of(s)) is not None}
        return dataclasses.replace(self.targets_from(self.target_offset + self.data.targets), frontiers=[],
                                   settings=[s for s in self.settings if s.key in keep])

    def targets_from(self, offset: int) -> Audit:
        """This audit with its targets from ``offset`` on in the target split's seeded order."""
        if offset == self.target_offset:
            return self
        return dataclasses.replace(self, target_offset=offset)

    @property
    def checkpoints(self) -> list[int]:
        return self.model.checkpoints

    @property
    def num_batches(self) -> int:
        return self.data.targets // self.data.batch_size

    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def images_per_client(self) -> int:
        """What each client holds: ``data.batch_size / protocol.clients``."""
        return self.data.batch_size // getattr(self.protocol, "clients", 1)

    def protocol_of(self, setting: DefenseSetting) -> Protocol:
        """The protocol of ``setting``'s updates: the audit's, with the setting's own number of clients."""
        return with_clients(self.protocol, setting.clients)

    def batch_size_of(self, setting: DefenseSetting) -> int:
        """Images in one of ``setting``'s updates: its own number of clients times each client's images."""
        if setting.clients is None:
            return self.data.batch_size
        return setting.clients * self.images_per_client

    def num_batches_of(self, setting: DefenseSetting) -> int:
        """How many of ``setting``'s updates the targets make."""
        return self.data.targets // self.batch_size_of(setting)

    def reference_of(self, setting: DefenseSetting) -> DefenseSetting | None:
        """The undefended reference that calibrates ``setting``'s verdicts: the one of its model and number of
        clients (``with_references``)."""
        return next((s for s in self.settings if s.calibrates is not None and world(s) == world(setting)), None)


def with_clients(protocol: Protocol, clients: int | None) -> Protocol:
    """``protocol`` with its secure aggregation over ``clients`` clients (None: as it is)."""
    return protocol if clients is None else dataclasses.replace(protocol, clients=clients)


def world(setting: DefenseSetting) -> tuple[str, int | None]:
    """What a setting's undefended reference must share with it: its model and its number of clients."""
    return model_label(setting.model), setting.clients


def model_label(model: ModelSection | None) -> str:
    """A setting's own model as text ("" for the audit's): settings of one model share a reference."""
    return "" if model is None else call_label(model.name or "", model.params)
