"""``budget:``: the wall time an audit may take, as written (``90s``, ``10m``, ``1h``), and the plan that fits the
audit into it (attack budgets scaled, attacks left out), kept in run.json so a rebuilt report reads the same audit."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from leakaudit.evaluator.audit.types import Audit

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$")
UNITS = {"s": 1, "m": 60, "h": 3600}
DURATION_FORM = "a duration like 90s, 10m or 1h"


def parse_duration(value: Any) -> float | None:
    """Seconds of a duration written ``90s``, ``10m``, ``1.5h`` (a bare number: seconds); None where ``value`` is
    not one, or is not positive."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := DURATION.match(value)):
        seconds = float(match.group(1)) * UNITS[match.group(2) or "s"]
    else:
        return None
    return seconds if seconds > 0 else None


def check_budget(value: Any, problems: list[str], key: str = "budget") -> float | None:
    """``budget:`` as seconds (None: no budget); a problem line naming ``key`` and the form where it is not one."""
    if value is None:
        return None
    seconds = parse_duration(value)
    if seconds is None:
        problems.append(f"{key}: expected {DURATION_FORM}, got {value!r}")
    return seconds


def duration_text(seconds: float) -> str:
    """Seconds as people read a wait: ``40 s``, ``3 min 20 s``, ``1 h 05 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def settles_early(audit: Audit) -> bool:
    """Whether a run of ``audit`` stops a step's attacks once its verdict is settled: under a budget or ``attacks:
    auto``, where verdicts are judged by the mean (an interval's end can fall when a stronger attack joins) and no
    frontier is searched (its later probes may need any reference's row)."""
    return ((audit.budget is not None or bool(audit.attack_choice)) and not audit.frontiers
            and audit.verdict.statistic == "mean")


#: run.json's record of an ``attacks: auto`` run's settled steps (a budget's plan keeps its own, under "budget").
SETTLED = "settled"


def skipped_of(run_info: dict[str, Any]) -> list[list]:
    """The [setting, attack, step, why] a run skipped once their step's verdict was settled, from its run.json (its
    budget's plan or ``attacks: auto``'s record; empty where it skipped nothing)."""
    return (run_info.get("budget") or run_info.get(SETTLED) or {}).get("skipped", [])


def apply_plan(audit: Audit, plan: dict[str, Any]) -> None:
    """Give ``audit`` the attacks a budget's plan runs: each scaled attack at its plan's parameters, each left-out
    attack gone (a rebuilt report and a resumed run read the run's own plan, not a new calibration)."""
    params = plan.get("params", {})
    dropped = set(plan.get("dropped", {}))
    audit.budget_left_out = [a for a in audit.attacks if a.label in dropped]
    audit.attacks = [dataclasses.replace(a, params=params[a.label]) if a.label in params else a
                     for a in audit.attacks if a.label not in dropped]
    audit.budget_plan = plan


def cuts_anything(plan: dict[str, Any] | None) -> bool:
    """Whether a budget's plan scaled down or left out any attack (a plan that fits cuts nothing)."""
    return bool(plan and (plan.get("params") or plan.get("dropped")))


def full_budget(plan: dict[str, Any]) -> str:
    """The ``budget:`` that runs the audit of ``plan`` in full, by its estimate (whole minutes, rounded up)."""
    return f"{math.ceil(plan['estimate'] / 60)}m"


def budget_lines(plan: dict[str, Any]) -> list[str]:
    """What a budget's plan did, for the terminal and the report: the budget against the full estimate, each
    attack scaled or left out, and the cells whose verdict was settled before their attack ran."""
    head = (f"budget {duration_text(plan['seconds'])}: the audit in full would take about "
            f"{duration_text(plan['estimate'])}")
    if not plan["cut"]:
        head += "; it fits, nothing cut"
    return [head, *(f"  cut: {line}" for line in plan["cut"]), *skipped_lines(plan.get("skipped", []))]


def skipped_lines(skipped: list[list]) -> list[str]:
    """The attacks a run did not run where a step's verdict was settled before them (a budget's plan's or
    ``attacks: auto``'s record), a line for all of them; none where it skipped nothing."""
    where: dict[str, dict[str, list[str]]] = {}
    for setting, attack, step, _ in skipped:
        where.setdefault(attack, {}).setdefault(setting, []).append(str(step))
    if not where:
        return []
    return ["  skipped where the step's verdict was already settled (a leak of individuals; on a reference, "
            "with every setting it calibrates leaking or vouched for): " + "; ".join(
                f"{attack} on " + ", ".join(f"{s} (step {', '.join(steps)})" for s, steps in by.items())
                for attack, by in where.items())]
