"""leakaudit: audit federated-learning privacy defenses against the strongest gradient-inversion
attacks that know them.

The public API::

    import leakaudit

    @leakaudit.hookimpl
    def register_defenses():
        return [MyDefense]          # a subclass of leakaudit.Defense

    audit = leakaudit.load_audit("audit.yaml")
    summary = leakaudit.run_audit(audit, "runs/mine")      # a typed leakaudit.Summary

    monitor = leakaudit.LeakMonitor(every=100, out="runs/training")
    model, optimizer, loader = monitor.attach(model, optimizer, loader)   # then train as before

Plugin authors need only the names below; the rooms under ``leakaudit.plugins``,
``leakaudit.defenses``, ``leakaudit.attacks`` and ``leakaudit.evaluator`` hold the rest.
"""
from importlib import import_module
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from pathlib import Path as _Path
from typing import TYPE_CHECKING

# Imported from the repository itself (``python -m pytest`` at its root puts the root first on sys.path, ahead of
# an installed tree): the rooms are found in their own folders beside this one, as pyproject.toml's package-dir
# maps them. An installed copy holds them inside this folder and is left as it is.
_REPOSITORY = _Path(__file__).parent.parent
if (_REPOSITORY / "pyproject.toml").is_file() and (_REPOSITORY / "plugins" / "__init__.py").is_file() \
        and not (_Path(__file__).parent / "plugins").is_dir():
    __path__.append(str(_REPOSITORY))

from leakaudit.plugins import Param, PluginError, hookimpl  # noqa: E402
from leakaudit.plugins.manager import load_registry  # noqa: E402

if TYPE_CHECKING:  # what a type checker sees (each name re-exported): the modules _LAZY imports from at run time
    from leakaudit.evaluator.audit.config import Audit as Audit, ConfigError as ConfigError, load_audit as load_audit
    from leakaudit.evaluator.live.api import BatchAudit as BatchAudit, audit_batch as audit_batch
    from leakaudit.evaluator.live.monitor import LeakMonitor as LeakMonitor
    from leakaudit.evaluator.results.types import (
        CellResult as CellResult, StepVerdict as StepVerdict, Summary as Summary, WorstCase as WorstCase,
    )
    from leakaudit.evaluator.run.runner import (
        RunError as RunError, report_folder as report_folder, run_audit as run_audit,
    )
    from leakaudit.plugins.attack import (
        Attack as Attack, Problem as Problem, Reconstruction as Reconstruction, ThreatModel as ThreatModel,
    )
    from leakaudit.plugins.components import (
        DatasetSpec as DatasetSpec, ImageData as ImageData, Metric as Metric, MetricUnavailable as MetricUnavailable,
        ModelSpec as ModelSpec,
    )
    from leakaudit.plugins.defense import (
        Defense as Defense, DeterministicDefense as DeterministicDefense, PrivacyProfile as PrivacyProfile,
        SharedUpdate as SharedUpdate,
    )
    from leakaudit.plugins.protocol import (
        ClientStep as ClientStep, FedAvg as FedAvg, FedSGD as FedSGD, LossFn as LossFn, OwnStep as OwnStep,
        Protocol as Protocol, TrainingRun as TrainingRun,
    )
    from leakaudit.plugins.stochastic import StochasticModule as StochasticModule
    from leakaudit.plugins.text import CausalLM as CausalLM, TokenModel as TokenModel

try:
    __version__ = _version("leakaudit")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

#: Where each public name lives, imported on first use (PEP 562): ``import leakaudit`` and ``leakaudit --help``
#: stay free of torch until a name that needs it is asked for.
_LAZY = {
    **dict.fromkeys(("Attack", "Problem", "Reconstruction", "ThreatModel"), "leakaudit.plugins.attack"),
    **dict.fromkeys(("DatasetSpec", "ImageData", "Metric", "MetricUnavailable", "ModelSpec"),
                    "leakaudit.plugins.components"),
    **dict.fromkeys(("Defense", "DeterministicDefense", "PrivacyProfile", "SharedUpdate"), "leakaudit.plugins.defense"),
    **dict.fromkeys(("ClientStep", "FedAvg", "FedSGD", "LossFn", "OwnStep", "Protocol", "TrainingRun"),
                    "leakaudit.plugins.protocol"),
    "StochasticModule": "leakaudit.plugins.stochastic",
    **dict.fromkeys(("CausalLM", "TokenModel"), "leakaudit.plugins.text"),
    **dict.fromkeys(("audit_batch", "BatchAudit"), "leakaudit.evaluator.live.api"),
    "LeakMonitor": "leakaudit.evaluator.live.monitor",
    **dict.fromkeys(("run_audit", "RunError", "report_folder"), "leakaudit.evaluator.run.runner"),
    **dict.fromkeys(("load_audit", "ConfigError", "Audit"), "leakaudit.evaluator.audit.config"),
    **dict.fromkeys(("Summary", "CellResult", "WorstCase", "StepVerdict"), "leakaudit.evaluator.results.types"),
}


def __getattr__(name: str):
    """A public name, imported from its module on first use."""
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'leakaudit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["__version__", "hookimpl", "Param", "PluginError", "load_registry", *_LAZY]
