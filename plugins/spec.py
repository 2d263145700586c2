"""Declared parameters of plugins, checked before any work starts."""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

_REQUIRED = object()


class PluginError(Exception):
    """A plugin could not be loaded or clashes with another one (one line, names the culprits)."""


@dataclass(frozen=True)
class Param:
    """One parameter of a defense, attack, model or dataset: its type, default and valid range."""

    default: Any = _REQUIRED
    type: type | tuple[type, ...] = float
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    help: str = ""
    exclusive_min: bool = False
    nullable: bool = False  # YAML's null is accepted (always so where the default is None: "not set")
    items: int | None = None  # also accepted: a list of exactly this many values, each checked as one value
    example: Any = None  # a typical value of a required parameter: what `leakaudit init` writes for it
    #: The parameter is a monotone privacy knob: "higher" (larger values protect more) or "lower"; a
    #: ``frontier:`` search bisects on it for the weakest setting that protects. None: not a knob.
    protects: str | None = None
    #: The attack's work grows in proportion to this parameter (its iterations, the updates it simulates): the time
    #: estimate measures the cost of one unit of each such parameter, and a ``budget:`` scales them down together.
    budget: bool = False
    #: The value names a file: where relative, it is read beside the audit file, as factories and plugins_dir are.
    file: bool = False

    def __post_init__(self) -> None:
        if self.protects not in (None, "higher", "lower"):
            raise ValueError(f"Param: protects is {self.protects!r}; choices: higher, lower (or None)")

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def problem(self, value: Any) -> str | None:
        """Why `value` is not acceptable, or None when it is."""
        if value is None and (self.nullable or self.default is None):
            return None
        if self.items is not None and isinstance(value, list):
            if len(value) != self.items:
                return f"{value!r} is not one value or a list of {self.items}"
            return next((f"[{i}]: {why}" for i, v in enumerate(value) if (why := self._scalar_problem(v))), None)
        return self._scalar_problem(value)

    def _scalar_problem(self, value: Any) -> str | None:
        if self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.type)
        if not ok:
            return f"{value!r} is not of type {self.type_name}"
        if self.type is float and not math.isfinite(value):
            return f"{value!r} is not a finite number"
        if self.choices is not None and value not in self.choices:
            return f"{value!r} is not one of the choices; choices: {', '.join(map(_as_yaml, self.choices))}"
        if self.min is not None:
            if self.exclusive_min and value <= self.min:
                return f"{value!r} must be greater than {self.min}"
            if value < self.min:
                return f"{value!r} is below the minimum {self.min}"
        if self.max is not None and value > self.max:
            return f"{value!r} is above the maximum {self.max}"
        return None

    @property
    def type_name(self) -> str:
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        return " or ".join(t.__name__ for t in types)

    def describe(self) -> str:
        parts = [self.type_name + ("" if self.items is None else f" (or a list of {self.items})")]
        if not self.required:
            parts.append(f"default {self.default!r}")
        elif self.example is not None:
            parts.append(f"required, e.g. {self.example!r}")
        if self.min is not None or self.max is not None:
            lo = "" if self.min is None else f"{'>' if self.exclusive_min else '>='}{self.min}"
            hi = "" if self.max is None else f"<={self.max}"
            parts.append(" ".join(x for x in (lo, hi) if x))
        if self.choices:
            parts.append("one of " + "|".join(map(str, self.choices)))
        if self.protects:
            parts.append(f"{self.protects} protects more: a frontier knob")
        return ", ".join(parts)


def resolve_params(spec: Mapping[str, Param], given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Fill defaults and check `given` against `spec`; raise ValueError listing every problem."""
    problems = check_params(spec, given, where)
    if problems:
        raise ValueError("; ".join(problems))
    out = {k: p.default for k, p in spec.items() if not p.required}
    out.update(given)
    return out


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message, the message's lines joined."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def import_failure(exc: BaseException) -> str:
    """Why running a module of the user's code failed, on one line (``sys.exit`` named as such: it would
    otherwise end leakaudit silently)."""
    return f"it called sys.exit({exc.code!r}) at import" if isinstance(exc, SystemExit) else one_line(exc)


def did_you_mean(name: Any, choices) -> str:
    """`` (did you mean 'x'?)`` for a misspelt name close to one of ``choices``; empty otherwise."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


ITEM_PROBLEM = re.compile(r"\[\d+\]: ")  # a problem of one item of a list value: "[1]: ..."


def check_params(spec: Mapping[str, Param], given: Mapping[str, Any], where: str) -> list[str]:
    """Every problem with `given` as lines '<where>.<key>: ...'."""
    problems = []
    for key, value in given.items():
        if key not in spec:
            choices = ", ".join(sorted(spec)) or "(none: takes no parameters)"
            problems.append(f"{where}.{key}: unknown parameter{did_you_mean(key, spec)}; choices: {choices}")
            continue
        why = spec[key].problem(value)
        if why:
            problems.append(f"{where}.{key}{'' if ITEM_PROBLEM.match(why) else ': '}{why}")
    unknown = [k for k in given if k not in spec]
    for key, p in spec.items():
        if p.required and key not in given and not any(did_you_mean(u, [key]) for u in unknown):
            problems.append(f"{where}.{key}: required parameter is missing ({p.describe()})")
    return problems


def _as_yaml(value: Any) -> str:
    """A choice as an audit file writes it (true and false, not Python's True and False)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
