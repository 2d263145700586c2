"""The reference pages of the documentation site, generated from the code: every audit key from the tables the
loader checks, every built-in component from the registry, the command line from its argparse parser, the
plugin hooks from their specification, and the Python API from the docstrings of what ``leakaudit`` exports. ``mkdocs build`` writes them through ``docs/hooks.py``; the suite checks
that nothing they list is undocumented (``undocumented``).
"""
from __future__ import annotations

import argparse
import inspect
import re
import typing
from importlib import import_module
from typing import Any, Iterator

from leakaudit.evaluator.audit import specs
from leakaudit.evaluator.audit.tuning import SCAN, TUNE
from leakaudit.evaluator.cli import _parser
from leakaudit.plugins import hookspecs
from leakaudit.plugins.manager import Registry, load_registry
from leakaudit.plugins.protocol import PROTOCOLS
from leakaudit.plugins.spec import Param

#: The audit file's sections, in the order a file is read: (title, where in the file, table).
SECTIONS: list[tuple[str, str, dict[str, Param]]] = [
    ("Top level", "", specs.TOP),
    ("data", "data:", specs.DATA),
    ("model", "model:", specs.MODEL),
    ("defenses", "defenses: [- ...]", specs.DEFENSE),
    ("defenses: chain members", "defenses: [- chain: [- ...]]", specs.MEMBER),
    ("defenses: frontier", "defenses: [- frontier: ...]", specs.FRONTIER),
    ("defenses: model", "defenses: [- model: ...]", specs.SETTING_MODEL),
    ("attacks", "attacks: [- ...]", specs.ATTACK),
    ("attacks: tune", "attacks: [- tune: ...]", TUNE),
    ("attacks: tune: scan", "attacks: [- tune: {scan: ...}]", SCAN),
    ("utility", "utility:", specs.UTILITY),
    ("verdict", "verdict:", specs.VERDICT),
    ("threat", "threat:", specs.THREAT),
    ("executor", "executor: {...}", specs.EXECUTOR),
    *((f"protocol: {name}", f"protocol: {{name: {name}, ...}}", cls.params)
      for name, cls in PROTOCOLS.items() if cls.params),
]
#: The names ``leakaudit`` exports, by what a reader does with them.
API = {
    "Audits": ["load_audit", "run_audit", "report_folder", "Audit", "ConfigError", "RunError"],
    "Results": ["Summary", "CellResult", "WorstCase", "StepVerdict"],
    "Your own training": ["LeakMonitor", "audit_batch", "BatchAudit"],
    "Writing plugins": ["hookimpl", "Param", "PluginError", "load_registry", "Defense", "DeterministicDefense",
                        "SharedUpdate", "PrivacyProfile", "Attack", "ThreatModel", "Problem", "Reconstruction",
                        "Metric", "MetricUnavailable", "ModelSpec", "DatasetSpec", "ImageData", "StochasticModule"],
    "Protocols and training steps": ["Protocol", "FedSGD", "FedAvg", "ClientStep", "OwnStep", "TrainingRun", "LossFn"],
}
#: The registry's kinds, as the reference names them.
KINDS = {"defense": "Defenses", "attack": "Attacks", "metric": "Metrics", "model": "Models", "dataset": "Datasets"}


def _cell(value: Any) -> str:
    """A value as a Markdown table cell (pipes escaped, newlines folded)."""
    return " ".join(str(value).replace("|", "\\|").split())


def _type(param: Param) -> str:
    types = param.type if isinstance(param.type, tuple) else (param.type,)
    return " or ".join(getattr(t, "__name__", str(t)) for t in types)


def _allowed(param: Param) -> str:
    if param.choices:
        return ", ".join(f"`{c}`" for c in param.choices)
    bounds = []
    if param.min is not None:
        bounds.append(f"{'>' if param.exclusive_min else '>='} {param.min}")
    if param.max is not None:
        bounds.append(f"<= {param.max}")
    return ", ".join(bounds) + (" or null" if param.nullable else "")


def param_table(params: dict[str, Param]) -> list[str]:
    """A Markdown table of ``params``: key, type, default, what is allowed, and what it does."""
    lines = ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    for key, param in params.items():
        default = "required" if param.required else f"`{param.default!r}`"
        lines.append(f"| `{key}` | {_type(param)} | {_cell(default)} | {_cell(_allowed(param))} | {_cell(param.help)} |")
    return lines


def audit_keys() -> str:
    """Every key of the audit file, section by section."""
    lines = ["# Audit file keys", "", "Generated from the tables `leakaudit validate` checks a file against "
             "(`evaluator/audit/specs.py`, `evaluator/audit/tuning.py`, the protocols' `params`). What each "
             "section does is told in [the audit file](../audit-file.md).", ""]
    for title, where, table in SECTIONS:
        lines += [f"## {title}", ""] + ([f"Written as `{where}`.", ""] if where else []) + param_table(table) + [""]
    return "\n".join(lines)


def _summary(kind: str, obj: Any) -> str:
    text = obj.__doc__ if kind in ("defense", "attack") else getattr(obj, "summary", "")
    return " ".join((text or "").split())


def builtins(registry: Registry | None = None) -> str:
    """Every built-in component by kind: what it is, its paper and modality, and its settings."""
    registry = registry or load_registry(entry_points=False)
    lines = ["# Built-in components", "", "Generated from the registry: what `leakaudit plugins` lists on an "
             "installation without outside plugins. Each name goes into an audit file's `name:`.", ""]
    for kind, title in KINDS.items():
        lines += [f"## {title}", ""]
        for name, entry in sorted(registry.entries[kind].items()):
            obj = entry.obj
            facts = [f for f in (getattr(obj, "paper", ""), _modality(obj)) if f]
            lines += [f"### `{name}`", "", _summary(kind, obj) + (f" ({'; '.join(facts)})" if facts else ""), ""]
            params = getattr(obj, "params", None) or {}
            lines += (param_table(params) if params else ["No settings."]) + [""]
    return "\n".join(lines)


def _modality(obj: Any) -> str:
    modalities = getattr(obj, "modalities", None) or (getattr(obj, "modality", None),)
    return "modality: " + ", ".join(m for m in modalities if m) if any(modalities) else ""


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction))]


def command_line() -> str:
    """Every subcommand of ``leakaudit`` with its usage and each argument's help."""
    parser = _parser()
    lines = ["# Command line", "", "Generated from the `leakaudit` command's parser (`evaluator/cli.py`).", "",
             f"{parser.description}", "", "| option | meaning |", "| --- | --- |"]
    lines += [f"| `{', '.join(a.option_strings) or a.dest}` | {_cell(a.help)} |" for a in _options(parser)]
    lines.append("")
    for name, help_text, sub in _subcommands(parser):
        lines += [f"## `leakaudit {name}`", "", _cell(help_text), "", "```text", sub.format_usage().strip(), "```", "",
                  "| argument | meaning |", "| --- | --- |"]
        lines += [f"| `{', '.join(a.option_strings) or a.dest}` | {_cell(a.help)} |" for a in _options(sub)]
        lines.append("")
    return "\n".join(lines)


def hooks() -> str:
    """Every hook a plugin may implement, with its signature and what it returns."""
    lines = ["# Plugin hooks", "", "Generated from `leakaudit.plugins.hookspecs`. A plugin implements any of them "
             "with `@leakaudit.hookimpl`; [writing plugins](../plugins.md) shows how.", ""]
    for name, fn in _hookspecs():
        lines += [f"## `{name}{inspect.signature(fn)}`", "", inspect.getdoc(fn) or "", ""]
    return "\n".join(lines)


def _hookspecs() -> list[tuple[str, Any]]:
    return [(n, f) for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if f.__module__ == hookspecs.__name__]


def _signature(obj: Any) -> str:
    """``(name: type = default, ...) -> returns`` as the source writes it (annotations unquoted), or "" without one."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without one
        return ""
    text = str(signature.replace(
        parameters=[p.replace(annotation=_Annotation(p.annotation)) if p.annotation is not p.empty else p
                    for p in signature.parameters.values()],
        return_annotation=(signature.empty if signature.return_annotation is signature.empty
                           else _Annotation(signature.return_annotation))))
    # a default that is a function reads as its name; no default keeps the address that changes every run
    text = re.sub(r"<function (\S+) at 0x[0-9a-f]+>", r"\1", text)
    return re.sub(r"<([^<>]+) at 0x[0-9a-f]+>", r"<\1>", text)


class _Annotation:
    """An annotation shown as written: a string annotation without the quotes ``repr`` would add."""

    def __init__(self, value: Any) -> None:
        self.text = value if isinstance(value, str) else inspect.formatannotation(value)

    def __repr__(self) -> str:
        return self.text


def _members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties a class defines itself, in source order."""
    return [(n, v) for n, v in vars(cls).items() if not n.startswith("_")
            and (inspect.isfunction(v) or isinstance(v, (property, classmethod, staticmethod)))]


def api() -> str:
    """Each name ``leakaudit`` exports: its signature, its docstring, and a class's own public methods."""
    import leakaudit

    lines = ["# Python API", "", "Generated from the docstrings of what `leakaudit` exports: everything a plugin "
             "author or a training script imports comes from `leakaudit` itself. The rooms under "
             "`leakaudit.plugins`, `leakaudit.defenses`, `leakaudit.attacks` and `leakaudit.evaluator` hold the rest "
             "([the architecture](../architecture.md) says what each holds).", ""]
    for section, names in API.items():
        lines += [f"## {section}", ""]
        for name in names:
            obj = getattr(leakaudit, name)
            kind = "class " if inspect.isclass(obj) else ""
            title = f"leakaudit.{name} = {obj}" if _is_alias(obj) else f"{kind}leakaudit.{name}{_signature(obj)}"
            lines += [f"### `leakaudit.{name}`", "", "```python", title, "```", "", _doc(obj, name), ""]
            for member, value in _members(obj) if inspect.isclass(obj) else []:
                fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                doc = _cell(_first_paragraph(inspect.getdoc(fn) or ""))
                lines += [f"- `{member}{'' if isinstance(value, property) else _signature(fn)}`" + (f": {doc}" if doc else "")]
            lines.append("")
    return "\n".join(lines)


def _is_alias(obj: Any) -> bool:
    """A type alias such as ``Callable[[Tensor, Tensor], Tensor]``: no docstring of its own."""
    return typing.get_origin(obj) is not None


#: The sections of a Google-style docstring, in the order they come (the example last).
DOC_SECTIONS = ("Args", "Returns", "Raises", "Example")


def sections(doc: str) -> dict[str, list[str]]:
    """A Google-style docstring cut at its sections: the prose before them under "", each section's lines (their
    first indent removed) under its name."""
    out: dict[str, list[str]] = {"": []}
    current = ""
    for line in doc.splitlines():
        if line.endswith(":") and line[:-1] in DOC_SECTIONS:
            current = line[:-1]
            out[current] = []
        else:
            out[current].append(line[4:] if current and line.startswith("    ") else line)
    return out


def entries(lines: list[str]) -> dict[str, str]:
    """An Args or Raises section's entries: each name with its text (continuation lines joined)."""
    out: dict[str, str] = {}
    for line in lines:
        if line and not line.startswith(" "):
            name, _, text = line.partition(": ")
            out[name] = text
        elif out and line.strip():
            last = list(out)[-1]
            out[last] += " " + line.strip()
    return out


def _markdown(doc: str) -> str:
    """A docstring as Markdown: the prose as it is, Args and Raises as lists, Returns as a paragraph and the
    example as a Python block."""
    parts = sections(doc)
    lines = list(parts[""])
    for name in DOC_SECTIONS:
        if name not in parts:
            continue
        lines += ["", f"**{name}**", ""]
        if name in ("Args", "Raises"):
            lines += [f"- `{key}`: {text}" for key, text in entries(parts[name]).items()]
        elif name == "Example":
            lines += ["```python", *[line for line in parts[name]], "```"]
        else:
            lines.append(" ".join(line.strip() for line in parts[name]).strip())
    return "\n".join(lines).strip()


def _doc(obj: Any, name: str = "") -> str:
    """The docstring of a class or function, as Markdown; of a type alias, the ``#:`` comment above it where it
    is defined."""
    if not _is_alias(obj):
        return _markdown(inspect.getdoc(obj) or "")
    import leakaudit

    source = inspect.getsource(import_module(leakaudit._LAZY[name])).splitlines()
    at = next((i for i, line in enumerate(source) if line.startswith(f"{name} = ")), 0)
    comment = []
    while at and source[at - 1].startswith("#:"):
        at -= 1
        comment.insert(0, source[at][2:].strip())
    return " ".join(comment)


def _first_paragraph(text: str) -> str:
    return text.split("\n\n", 1)[0]


def pages() -> dict[str, str]:
    """Each generated page's path under docs/ and its Markdown."""
    return {"reference/audit-keys.md": audit_keys(), "reference/builtins.md": builtins(),
            "reference/cli.md": command_line(), "reference/hooks.md": hooks(), "reference/api.md": api()}


def undocumented(registry: Registry | None = None) -> list[str]:
    """What the reference would show without its doc: an audit key or a component setting without help, a
    built-in without a description, a command-line argument or a hook without its text."""
    registry = registry or load_registry(entry_points=False)
    out = [f"audit key {title}.{key}" for title, _, table in SECTIONS for key, p in table.items() if not p.help]
    for kind in KINDS:
        for name, entry in registry.entries[kind].items():
            if not _summary(kind, entry.obj):
                out.append(f"{kind} {name}: no description")
            out += [f"{kind} {name}: setting {key}" for key, p in (getattr(entry.obj, "params", None) or {}).items()
                    if not p.help]
    parser = _parser()
    out += [f"option {', '.join(a.option_strings) or a.dest}" for a in _options(parser) if not a.help]
    for name, help_text, sub in _subcommands(parser):
        out += [f"leakaudit {name}"] if not help_text else []
        out += [f"leakaudit {name} {', '.join(a.option_strings) or a.dest}" for a in _options(sub) if not a.help]
    out += [f"hook {name}" for name, fn in _hookspecs() if not inspect.getdoc(fn)]
    import leakaudit

    out += [f"leakaudit.{name}" for names in API.values() for name in names
            if not _doc(getattr(leakaudit, name), name)]
    return out
