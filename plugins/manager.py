"""Plugin discovery (built-ins, installed entry points, drop-in folders) and the name registry."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pluggy

from leakaudit.plugins import PROJECT, PluginError, hookspecs
from leakaudit.plugins.spec import import_failure

#: Built-in plugin modules, registered exactly like outside plugins.
BUILTIN_PLUGINS = (
    "leakaudit.defenses.noise",
    "leakaudit.defenses.pruning",
    "leakaudit.defenses.clipping",
    "leakaudit.defenses.dpsgd",
    "leakaudit.defenses.soteria",
    "leakaudit.defenses.ats",
    "leakaudit.defenses.precode",
    "leakaudit.defenses.bayesian",
    "leakaudit.defenses.compression",
    "leakaudit.defenses.text",
    "leakaudit.defenses.flower",
    "leakaudit.defenses.nvflare",
    "leakaudit.attacks.gradient_matching",
    "leakaudit.attacks.fedleak",
    "leakaudit.attacks.analytic",
    "leakaudit.attacks.bayes",
    "leakaudit.attacks.precode",
    "leakaudit.attacks.bayesian",
    "leakaudit.attacks.rgap",
    "leakaudit.attacks.cinet",
    "leakaudit.attacks.imprint",
    "leakaudit.attacks.ares",
    "leakaudit.attacks.decomposition",
    "leakaudit.attacks.fedavg_epochs",
    "leakaudit.attacks.learned",
    "leakaudit.attacks.text",
    "leakaudit.evaluator.zoo.metrics",
    "leakaudit.evaluator.zoo.models",
    "leakaudit.evaluator.zoo.datasets",
    "leakaudit.evaluator.zoo.text",
)

#: Registry kinds and the hook that fills each.
KINDS = {
    "defense": "register_defenses",
    "attack": "register_attacks",
    "metric": "register_metrics",
    "model": "register_models",
    "dataset": "register_datasets",
}


def get_plugin_manager(plugin_dirs: Iterable[str | Path] = (), entry_points: bool = True) -> pluggy.PluginManager:
    """A PluginManager with the built-ins, installed entry points and drop-in folders loaded."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for modname in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(modname), name=f"builtin:{modname}")
    if entry_points:
        _load_entry_points(pm)
    for folder in plugin_dirs:
        _load_folder(pm, Path(folder))
    _check_hook_names(pm)
    return pm


def _check_hook_names(pm: pluggy.PluginManager) -> None:
    """A misspelt hook would be silently ignored: reject it, naming the plugin and the valid hooks."""
    known = sorted(n for n in dir(hookspecs) if getattr(getattr(hookspecs, n), "leakaudit_spec", None))
    for name, caller in vars(pm.hook).items():
        if name.startswith("_") or caller.has_spec():
            continue
        for impl in caller.get_hookimpls():
            if not impl.optionalhook:
                raise PluginError(f"plugin {impl.plugin_name}: unknown hook {name!r}; hooks: {', '.join(known)}")


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    for ep in importlib.metadata.entry_points(group=PROJECT):
        dist = ep.dist.name if ep.dist is not None else "?"
        name = f"entrypoint:{ep.name} ({dist})"
        try:
            plugin = ep.load()
        except (Exception, SystemExit) as exc:  # a broken third-party plugin must be named, not hidden
            raise PluginError(f"plugin entry point {ep.name!r} of {dist} ({ep.value}) failed to load: "
                              f"{import_failure(exc)}") from None
        _register(pm, plugin, name)


def _load_folder(pm: pluggy.PluginManager, folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise PluginError(f"plugins folder {folder} is a file; give the folder that holds the plugin *.py files")
    if not folder.is_dir():
        raise PluginError(f"plugins folder {folder} does not exist")
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        modname = f"leakaudit_dropin_{path.stem}"
        spec = importlib.util.spec_from_file_location(modname, path)
        if spec is None or spec.loader is None:
            raise PluginError(f"plugin file {path} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:
            del sys.modules[modname]
            raise PluginError(f"plugin file {path} failed to load: {import_failure(exc)}") from None
        _register(pm, module, f"file:{path}")


def _register(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    if pm.is_registered(plugin):
        return
    try:
        pm.register(plugin, name=name)
    except ValueError as exc:
        raise PluginError(f"plugin {name}: {exc}") from None
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {name}: {exc}") from None


@dataclass(frozen=True)
class Entry:
    """One registered component and the plugin it came from."""

    kind: str
    name: str
    obj: Any
    origin: str

    @property
    def paper(self) -> str:
        """The paper the component comes from (author, year), where it declares one."""
        return getattr(self.obj, "paper", "") or ""

    @property
    def summary(self) -> str:
        """The docstring's first paragraph on one line (or the spec's own ``summary``), reStructuredText's
        literal quotes taken off and the paper, which ``paper`` gives, not repeated at its start."""
        doc = getattr(self.obj, "summary", None) or (getattr(self.obj, "__doc__", None) or "")
        text = re.sub(r"``([^`]+)``", r"\1", " ".join(doc.strip().split("\n\n")[0].split()))
        return text.removeprefix(f"{self.paper}: ") if self.paper else text

    @property
    def description(self) -> str:
        """The whole docstring, dedented (``leakaudit plugins KIND NAME`` shows it)."""
        return inspect.cleandoc(getattr(self.obj, "__doc__", None) or getattr(self.obj, "summary", "") or "")


@dataclass
class Registry:
    """Every defense, attack, metric, model and dataset by name, with its origin."""

    entries: dict[str, dict[str, Entry]] = field(default_factory=lambda: {k: {} for k in KINDS})
    pm: pluggy.PluginManager | None = None

    def add(self, kind: str, obj: Any, origin: str) -> None:
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {origin}: a {kind} without a string 'name': {obj!r}")
        table = self.entries[kind]
        if name in table:
            raise PluginError(f"{kind} name {name!r} is registered by both {table[name].origin} and {origin}")
        problem = _update_kind_problem(kind, obj)
        if problem:
            from leakaudit.plugins.defense import UPDATE_KINDS

            raise PluginError(f"plugin {origin}: {kind} {name!r}: {problem}; choices: {', '.join(UPDATE_KINDS)}")
        table[name] = Entry(kind, name, obj, origin)

    def get(self, kind: str, name: str) -> Any:
        return self.entries[kind][name].obj

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def __iter__(self):
        for kind in KINDS:
            yield from (self.entries[kind][n] for n in self.names(kind))


def _update_kind_problem(kind: str, obj: Any) -> str | None:
    """What is wrong with an attack's ``reads`` (a tuple of kinds of update) or a defense's ``shares`` (one kind),
    as ``UPDATE_KINDS`` names them; None where nothing is."""
    from leakaudit.plugins.defense import UPDATE_KINDS

    if kind == "attack":
        reads = getattr(obj, "reads", ())
        if isinstance(reads, str) or not isinstance(reads, (tuple, list)):
            return f"reads is {reads!r}; expected a tuple of kinds of update, e.g. ('full',)"
        unknown = [k for k in reads if k not in UPDATE_KINDS]
        return f"reads names {', '.join(map(repr, unknown))}, not a kind of update" if unknown else None
    if kind == "defense":
        shares = getattr(obj, "shares", "full")
        return None if shares in UPDATE_KINDS else f"shares is {shares!r}, not a kind of update"
    return None


def build_registry(pm: pluggy.PluginManager) -> Registry:
    """Call every register_* hook implementation, one plugin at a time, to record origins."""
    registry = Registry(pm=pm)
    for kind, hook in KINDS.items():
        for impl in reversed(getattr(pm.hook, hook).get_hookimpls()):
            try:
                provided = impl.function()
            except Exception as exc:
                raise PluginError(f"plugin {impl.plugin_name}: {hook}() raised {type(exc).__name__}: {exc}") from None
            for obj in provided or ():
                registry.add(kind, obj, impl.plugin_name)
    return registry


def load_registry(plugin_dirs: Iterable[str | Path] = (), entry_points: bool = True) -> Registry:
    """Discover every plugin and return the filled registry.

    Args:
        plugin_dirs: drop-in folders whose modules implement the hooks, loaded beside the built-ins.
        entry_points: also load installed packages' ``leakaudit`` entry points.

    Returns:
        The registry: each kind's components by name, with where each came from.

    Raises:
        PluginError: a plugins folder is missing or is a file, a plugin file or entry point cannot be loaded, or
            a plugin implements a hook that does not exist.

    Example:
        registry = leakaudit.load_registry(["my_plugins"])
        print(registry.names("defense"))
    """
    return build_registry(get_plugin_manager(plugin_dirs, entry_points))


def param_rows(params: dict[str, Any]) -> list[dict[str, Any]]:
    """Each declared parameter as a row: name, its one-line description, help, and the fields it is checked by."""
    rows = []
    for key, p in params.items():
        rows.append({"name": key, "describe": p.describe(), "help": p.help, "type": p.type_name,
                     "required": p.required, "default": None if p.required else p.default, "example": p.example,
                     "min": p.min, "max": p.max, "exclusive_min": p.exclusive_min, "choices": p.choices,
                     "nullable": p.nullable, "items": p.items, "protects": p.protects})
    return rows


def facts(entry: Entry) -> dict[str, str]:
    """What a defense or attack is, in the terms an audit uses (empty for other kinds)."""
    obj = entry.obj
    if entry.kind == "defense":
        from leakaudit.plugins.defense import FULL, UPDATE_KINDS, Defense

        out = {"randomness": "deterministic" if obj.deterministic else "random (draws from the round's generator)",
               "likelihood": ("declared: the Bayes adversary (bayes) applies; check it with "
                              "leakaudit.testing.check_defense") if obj.declares_likelihood() else
                             "none declared: the Bayes adversary does not apply"}
        if obj.privacy_profile is not Defense.privacy_profile:
            out["guarantee"] = ("declares a privacy profile where it gives one (gaussian: after a clip): the report "
                                "holds every attack's identification to the bound it sets")
        if obj.wrap_model is not Defense.wrap_model:
            out["model"] = "may change the architecture (wrap_model)"
        if obj.shares_itself():
            out["update"] = "computed by the defense from the model and inputs (cannot be a chain member)"
        if obj.shares != FULL:
            out["shares"] = (f"{obj.shares}: {UPDATE_KINDS.get(obj.shares, obj.shares)}; only an attack that reads "
                             "this kind of update calibrates its \"protects\"")
        return out
    if entry.kind == "attack":
        from leakaudit.plugins.attack import ATTACKERS

        out = {"role": "adaptive: built on what the defense does" if obj.uses_defense else
               "naive: knows the model, not the defense",
               "attacker": (f"{obj.attacker}: {ATTACKERS[obj.attacker]} (Carletti et al. 2025)"
                            if obj.attacker in ATTACKERS else "undeclared (set attacker: one of "
                            + ", ".join(ATTACKERS) + ")")}
        out["reads"] = (", ".join(obj.reads) + ": the kinds of update whose \"protects\" it calibrates (a "
                        "defense that shares adapters or no embedding gradient needs an attack that reads that kind)")
        if obj.needs_defense:
            out["calibration"] = "needs its defense in the model: not run on the undefended reference"
        budgets = "; ".join(f"{device if len(obj.auto_params) > 1 else 'any device'}: "
                            f"{', '.join(f'{k}={v}' for k, v in params.items()) or 'its defaults'}"
                            for device, params in obj.auto_params.items())
        out["auto"] = (f"run by attacks: auto where it applies, at {budgets}" if obj.auto_params
                       else f"left out of attacks: auto ({obj.auto_skip})")
        return out
    if entry.kind == "metric":
        return {"leakage": "higher is more" if obj.higher_is_better else "lower is more", "scores": obj.on}
    return {}

