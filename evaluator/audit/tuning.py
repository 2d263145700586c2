"""The adaptive attacker: a budgeted search over an attack's hyperparameters before it attacks.

``tune:`` on an attack in the audit file; per defense setting and checkpoint the
runner tries ``budget`` settings on tuning images drawn from the training split
(the attacker's own data, never an attacked target), the untuned setting first,
and attacks every target with the best. Balunovic et al. 2022: untuned attacks understate
leakage, so an evaluator must tune them.

With ``scan:`` the search has two stages, as in Balunovic et al. 2022 (Appendix A.3): one parameter (the prior
weight beta) is first scanned on a log scale with the others untuned; the grid then searches it over
``[best / factor, best * factor]`` beside the ``space``. Both stages count against the one budget.
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import Any, cast

import torch

from leakaudit.evaluator.audit.specs import DEFAULT_LEAKAGE_METRIC
from leakaudit.plugins.attack import Attack
from leakaudit.plugins.spec import Param, check_params


TUNE = {
    "budget": Param(8, int, min=1, help="settings tried, the untuned one included"),
    "space": Param(type=dict, help="candidate values per parameter; dotted keys reach into mappings (priors.tv)"),
    "metric": Param(DEFAULT_LEAKAGE_METRIC, str, help="image metric that picks the winner"),
    "targets": Param(1, int, min=1, help="tuning batches drawn from the training split"),
    "scan": Param(None, dict, help="a first stage: one parameter on a log scale, then refined in the grid "
                                   "(param, low, high, per_decade, refine, factor)"),
}

SCAN = {
    "param": Param(type=str, help="the parameter scanned first, dotted keys allowed (priors.tv: the prior weight)"),
    "low": Param(type=float, min=0.0, exclusive_min=True, help="lowest value of the log scan"),
    "high": Param(type=float, min=0.0, exclusive_min=True, help="highest value of the log scan"),
    "per_decade": Param(1, int, min=1, help="scan values per factor of ten"),
    "refine": Param(5, int, min=1, help="values of param in the grid, log-spaced over [best/factor, best*factor]"),
    "factor": Param(2.0, float, min=1.0, exclusive_min=True, help="how far the grid reaches either side of the "
                                                                  "scan's best"),
}


@dataclass(frozen=True)
class ScanSpec:
    """A validated ``tune.scan`` section: the first stage of a two-stage search."""

    param: str
    low: float
    high: float
    per_decade: int = 1
    refine: int = 5
    factor: float = 2.0

    def values(self) -> list[float]:
        """The scan's values, log-spaced from ``low`` to ``high``, each to 3 significant digits."""
        steps = max(1, round(math.log10(self.high / self.low) * self.per_decade))
        return [float(f"{self.low * (self.high / self.low) ** (i / steps):.3g}") for i in range(steps + 1)]

    def around(self, best: float) -> list[float]:
        """The grid's values of ``param``: ``refine`` points log-spaced over [best/factor, best*factor]."""
        if self.refine == 1:
            return [best]
        return [float(f"{best * self.factor ** (2 * i / (self.refine - 1) - 1):.3g}") for i in range(self.refine)]


@dataclass(frozen=True)
class TuneSpec:
    """A validated ``tune:`` section."""

    space: dict[str, list]
    budget: int = 8
    metric: str = DEFAULT_LEAKAGE_METRIC
    targets: int = 1
    scan: ScanSpec | None = None

    def space_after(self, best: float | None) -> dict[str, list]:
        """The grid of the second stage: ``space`` and, when scanning, the scanned parameter around ``best``."""
        if self.scan is None or best is None:
            return dict(self.space)
        return {**self.space, self.scan.param: self.scan.around(best)}


def with_value(params: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of ``params`` with ``dotted`` (``lr`` or ``priors.tv``) set to ``value``."""
    out = copy.deepcopy(params)
    head, _, rest = dotted.partition(".")
    if rest:
        out[head] = {**out.get(head, {}), rest: value}
    else:
        out[head] = value
    return out


def scan_candidates(spec: TuneSpec, base: dict[str, Any], defaults: dict[str, Any]) -> list[dict[str, Any]]:
    """The first stage of a scanning search: the untuned parameters, then each scan value with the rest untuned."""
    start = {**defaults, **base}
    out, scan = [start], spec.scan
    for v in scan.values() if scan is not None else []:
        params = with_value(start, cast(ScanSpec, scan).param, v)
        if params not in out:
            out.append(params)
    return out


def candidates(spec: TuneSpec, base: dict[str, Any], defaults: dict[str, Any], seed: int,
               best: float | None = None) -> list[dict[str, Any]]:
    """Every trial of a search, in order: the untuned parameters first, then up to ``budget`` distinct points,
    seeded. A scanning search's trials are its scan, then (once the scan's ``best`` value is known) its grid."""
    start = {**defaults, **base}
    out = scan_candidates(spec, base, defaults)
    if spec.scan is not None and best is None:
        return out
    space = spec.space_after(best)
    keys = sorted(space)
    grid = [dict(zip(keys, combo)) for combo in itertools.product(*(space[k] for k in keys))]
    order = torch.randperm(len(grid), generator=torch.Generator().manual_seed(seed)).tolist()
    for i in order:
        if len(out) >= spec.budget:
            break
        params = start
        for k, v in grid[i].items():
            params = with_value(params, k, v)
        if params not in out:
            out.append(params)
    return out


def scan_best(spec: TuneSpec, trials: list[dict[str, Any]], scanned: int, registry: Any) -> float | None:
    """The scanned parameter's value in the best of one search's first ``scanned`` trials (its scan stage);
    None until each of them has a row."""
    first = [t for t in trials if t["trial"] < scanned]
    if len({t["trial"] for t in first}) < scanned:
        return None
    (row,) = winners(first, registry).values()
    return value_at(row["params"], cast(ScanSpec, spec.scan).param)


def check_tune(section: Any, attack_cls: type[Attack], base: dict[str, Any], metrics: dict, where: str) -> tuple[
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
    scan = _check_scan(section.get("scan"), attack_cls, base, section, f"{where}.scan", problems)
    metric = section.get("metric", DEFAULT_LEAKAGE_METRIC)
    if metric in metrics and metrics[metric].on != "images":
        problems.append(f"{where}.metric: {metric!r} does not score images; choose an image metric")
    elif metric not in metrics:
        problems.append(f"{where}.metric: {metric!r} is not a registered metric; choices: "
                        f"{', '.join(sorted(n for n, m in metrics.items() if m.on == 'images'))}")
    if problems:
        return None, problems
    return TuneSpec(space=dict(space or {}), budget=section.get("budget", 8), metric=metric,
                    targets=section.get("targets", 1), scan=scan), []


def _check_scan(section: Any, attack_cls: type[Attack], base: dict[str, Any], tune: dict, where: str,
                problems: list[str]) -> ScanSpec | None:
    """Validate a ``tune.scan`` mapping; its problems are appended to ``problems``."""
    if not isinstance(section, dict):
        return None
    found = check_params(SCAN, section, where)
    if found:
        problems.extend(found)
        return None
    scan = ScanSpec(**section)
    head = scan.param.partition(".")[0]
    if head not in attack_cls.params:
        problems.append(f"{where}.param: {scan.param!r} is not a parameter of {attack_cls.name!r}; "
                        f"choices: {', '.join(sorted(attack_cls.params))}")
    elif scan.param in (tune.get("space") or {}):
        problems.append(f"{where}.param: {scan.param!r} is also in tune.space; the scan sets its grid "
                        "(remove it from space)")
    elif scan.high <= scan.low:
        problems.append(f"{where}.high: {scan.high!r} must be greater than low ({scan.low!r})")
    elif (budget := tune.get("budget", TUNE["budget"].default)) < len(scan.values()) + 2:
        problems.append(f"{where}: {len(scan.values())} scan values and the untuned setting leave no grid "
                        f"trial in tune.budget {budget}; raise the budget to at least {len(scan.values()) + 2} "
                        "or scan fewer values")
    else:
        for bound in ("low", "high"):
            try:
                attack_cls(**with_value(base, scan.param, getattr(scan, bound)))
            except (ValueError, TypeError) as exc:
                problems.append(f"{where}.{bound}: {exc}")
                break  # the other bound would only repeat it
    return scan


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


def position(values: list, value: Any) -> str:
    """Where ``value`` sits on the grid ``values``: ``lowest`` or ``highest`` of a numeric grid (the optimum
    may lie beyond it), ``inside``, ``one of`` a categorical grid, or ``off the grid`` (the untuned value)."""
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if value not in values:
        return "off the grid"
    if not numeric or len(values) < 2:
        return "one of"
    if value == min(values):
        return "lowest"
    return "highest" if value == max(values) else "inside"


def grid_positions(space: dict[str, list], params: dict[str, Any]) -> dict[str, str]:
    """The ``position`` of each searched parameter of ``params`` on its grid in ``space``."""
    return {key: position(values, value_at(params, key)) for key, values in space.items()}
