"""leakaudit: audit federated-learning privacy defenses against the strongest gradient-inversion
attacks that know them.

The public API::

    import leakaudit

    @leakaudit.hookimpl
    def register_defenses():
        return [MyDefense]          # a subclass of leakaudit.Defense

    audit = leakaudit.load_audit("audit.yaml")
    summary = leakaudit.run_audit(audit, "runs/mine")

    monitor = leakaudit.LeakMonitor(every=100, out="runs/training")
    model, optimizer, loader = monitor.attach(model, optimizer, loader)   # then train as before

Plugin authors need only the names below; the rooms under ``leakaudit.plugins``,
``leakaudit.defenses``, ``leakaudit.attacks`` and ``leakaudit.evaluator`` hold the rest.
"""
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from leakaudit.plugins import Param, PluginError, hookimpl
from leakaudit.plugins.attack import Attack, Problem, Reconstruction, ThreatModel
from leakaudit.plugins.components import (
    DatasetSpec,
    ImageData,
    Metric,
    MetricUnavailable,
    ModelSpec,
)
from leakaudit.plugins.defense import Defense, DeterministicDefense, PrivacyProfile, SharedUpdate
from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.protocol import ClientStep, FedAvg, FedSGD, OwnStep, Protocol

try:
    __version__ = _version("leakaudit")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    """The engine's entry points, imported on first use so that plugins stay light to import."""
    if name in ("audit_batch", "BatchAudit"):
        from leakaudit.evaluator import api

        return getattr(api, name)
    if name == "LeakMonitor":
        from leakaudit.evaluator import monitor

        return monitor.LeakMonitor
    if name in ("run_audit", "RunError", "report_folder"):
        from leakaudit.evaluator import runner

        return getattr(runner, name)
    if name in ("load_audit", "ConfigError", "Audit"):
        from leakaudit.evaluator import config

        return getattr(config, name)
    raise AttributeError(f"module 'leakaudit' has no attribute {name!r}")


__all__ = ["__version__", "hookimpl", "Param", "PluginError", "Defense", "DeterministicDefense", "PrivacyProfile",
           "SharedUpdate", "Attack", "Problem", "Reconstruction", "ThreatModel", "ClientStep", "Protocol", "FedSGD", "FedAvg", "OwnStep",
           "Metric", "MetricUnavailable", "ModelSpec", "DatasetSpec", "ImageData", "load_registry",
           "load_audit", "ConfigError", "Audit", "run_audit", "RunError", "report_folder", "audit_batch", "BatchAudit", "LeakMonitor"]
