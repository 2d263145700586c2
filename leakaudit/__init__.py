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

from leakaudit.plugins import Param, PluginError, hookimpl
from leakaudit.plugins.manager import load_registry

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
    **dict.fromkeys(("ClientStep", "FedAvg", "FedSGD", "OwnStep", "Protocol"), "leakaudit.plugins.protocol"),
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
