"""The adaptive attacker: a budgeted search over an attack's hyperparameters before it attacks.

``tune:`` on an attack in the audit file; per defense setting and checkpoint the
runner tries ``budget`` settings on tuning images drawn from the training split
(the attacker's own data, never an attacked target), the untuned setting first,
and attacks every target with the best. Balunovic et al. 2022: untuned attacks understate
leakage, so an evaluator must tune them.
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from leakaudit.plugins.spec import Param, check_params

TUNE = {
    "budget": Param(8, int, min=1, help="settings tried, the untuned one included"),
    "space": Param(type=dict, help="candidate values per parameter; dotted keys reach into mappings (priors.tv)"),
    "metric": Param("psnr", str, help="image metric that picks the winner"),
    "targets": Param(1, int, min=1, help="tuning batches drawn from the training split"),
}


@dataclass(frozen=True)
class TuneSpec:
    """A validated ``tune:`` section."""

    space: dict[str, list]
    budget: int = 8
    metric: str = "psnr"
    targets: int = 1


def with_value(params: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of ``params`` with ``dotted`` (``lr`` or ``priors.tv``) set to ``value``."""
    out = copy.deepcopy(params)
    head, _, rest = dotted.partition(".")
    if rest:
        out[head] = {**out.get(head, {}), rest: value}
    else:
        out[head] = value
    return out


def candidates(spec: TuneSpec, base: dict[str, Any], defaults: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    """The untuned parameters first, then up to ``budget - 1`` distinct points of the space, seeded."""
    start = {**defaults, **base}
    keys = sorted(spec.space)
    grid = [dict(zip(keys, combo)) for combo in itertools.product(*(spec.space[k] for k in keys))]
    order = torch.randperm(len(grid), generator=torch.Generator().manual_seed(seed)).tolist()
    out, seen = [start], [start]
    for i in order:
        params = start
        for k, v in grid[i].items():
            params = with_value(params, k, v)
        if params not in seen:
            seen.append(params)
            out.append(params)
        if len(out) == spec.budget:
            break
    return out


def check_tune(section: Any, attack_cls: type, base: dict[str, Any], metrics: dict, where: str) -> tuple[
        TuneSpec | None, list[str]]:
    """Validate a ``tune:`` mapping against the attack's parameters; every value is tried on the attack."""
    if not isinstance(section, dict):
        return None, [f"{where}: expected a mapping with budget, space, metric, targets"]
    problems = check_params(TUNE, section, where)
    space = section.get("space")
    if isinstance(space, dict):
        for key, values in space.items():
            head = key.partition(".")[0]
            if head not in attack_cls.params:
                problems.append(f"{where}.space.{key}: not a parameter of {attack_cls.name!r}; "
                                f"choices: {', '.join(sorted(attack_cls.params))}")
            elif not isinstance(values, list) or not values:
                problems.append(f"{where}.space.{key}: expected a non-empty list of values, got {values!r}")
            else:
                for i, v in enumerate(values):
                    try:
                        attack_cls(**with_value(base, key, v))
                    except (ValueError, TypeError) as exc:
                        problems.append(f"{where}.space.{key}[{i}]: {exc}")
    metric = section.get("metric", "psnr")
    if metric in metrics and metrics[metric].on != "images":
        problems.append(f"{where}.metric: {metric!r} does not score images; choose an image metric")
    elif metric not in metrics:
        problems.append(f"{where}.metric: {metric!r} is not a registered metric; choices: "
                        f"{', '.join(sorted(n for n, m in metrics.items() if m.on == 'images'))}")
    if problems:
        return None, problems
    return TuneSpec(space=dict(space), budget=section.get("budget", 8), metric=metric,
                    targets=section.get("targets", 1)), []


def winners(rows: list[dict[str, Any]], registry: Any) -> dict[tuple, dict[str, Any]]:
    """Best trial per (setting, attack, checkpoint) by its metric's direction in ``registry``; ties go to the
    earliest trial (the untuned one first)."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r["trial"]):
        key = (r["setting"], r["attack"], r["checkpoint"])
        sign = 1 if registry.get("metric", r["metric"]).higher_is_better else -1
        if key not in best or sign * r["score"] > sign * best[key]["score"]:
            best[key] = r
    return best


def value_at(params: dict[str, Any], dotted: str) -> Any:
    """The value of ``dotted`` (``lr`` or ``priors.tv``) in ``params`` (None when absent)."""
    head, _, rest = dotted.partition(".")
    value = params.get(head)
    return value.get(rest) if rest and isinstance(value, dict) else (None if rest else value)


def grid_positions(space: dict[str, list], params: dict[str, Any]) -> dict[str, str]:
    """Where each searched parameter of ``params`` sits on its grid: ``lowest`` or ``highest`` of a numeric
    grid (the optimum may lie beyond it), ``inside``, ``one of`` a categorical grid, or ``off the grid`` (the
    untuned value)."""
    out = {}
    for key, values in space.items():
        value = value_at(params, key)
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if value not in values:
            out[key] = "off the grid"
        elif not numeric or len(values) < 2:
            out[key] = "one of"
        elif value == min(values):
            out[key] = "lowest"
        elif value == max(values):
            out[key] = "highest"
        else:
            out[key] = "inside"
    return out
