"""The ``frontier:`` search: bisect a defense's monotone knob, in log space on the verdict, for the weakest
setting that protects.

Each probe is a setting judged as any other (every attack of the audit, the calibration reference, the same
targets, seeds and steps), so the search reads only verdicts: ``search`` takes a function that judges one value
of the knob, and the runner gives it one that trains and attacks the setting when its rows are not written yet.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from leakaudit.evaluator.audit.types import FrontierSpec

PROTECTING = ("protects", "protects but unusable")  # the privacy side of a verdict: what the search bisects on


@dataclass
class FrontierSearch:
    """What one search found: its probes in the order judged, the weakest value that protects and the strongest
    that leaks (either None where the range holds none), and why it stopped."""

    spec: FrontierSpec
    probes: list[tuple[float, str | None]] = field(default_factory=list)
    protecting: float | None = None
    leaking: float | None = None
    status: str = ""


def factor(a: float, b: float) -> float:
    """How far apart two positive values are, as a ratio >= 1."""
    return max(a, b) / min(a, b)


def midpoint(spec: FrontierSpec, a: float, b: float) -> float | None:
    """The geometric mean of ``a`` and ``b`` (an integer knob's rounded; a float's to 3 significant digits, so
    that settings read well), or None where no value lies strictly between them."""
    mid = math.sqrt(a * b)
    mid = round(mid) if spec.integer else float(f"{mid:.3g}")
    return mid if min(a, b) < mid < max(a, b) else None


def most_probes(spec: FrontierSpec) -> int:
    """The most settings a search judges: both ends, then one halving of the log range per probe until it is
    within the tolerance (an integer knob: until no integer is left between), at most ``spec.probes``."""
    halvings = math.ceil(math.log2(math.log(spec.high / spec.low) / math.log(spec.tolerance)))
    if spec.integer:
        halvings = min(halvings, math.ceil(math.log2(max(1, spec.high - spec.low))))
    return min(spec.probes, 2 + max(0, halvings))


def search(spec: FrontierSpec, verdict_of: Callable[[float], str | None]) -> FrontierSearch:
    """Judge the strongest end, then the weakest, then bisect between the strongest leaking value and the weakest
    protecting one until they are within ``spec.tolerance`` or ``spec.probes`` settings are judged."""
    found = FrontierSearch(spec)

    def judge(value: float) -> str | None:
        verdict = verdict_of(value)
        found.probes.append((value, verdict))
        return verdict

    def unjudged(value: float, verdict: str | None) -> FrontierSearch:
        found.status = (f"stopped: {spec.knob}={value:g} is {verdict or 'not judged'}, so the search cannot tell "
                        "which side of the frontier it is on")
        return found

    verdict = judge(spec.strong)
    if verdict not in PROTECTING:
        if verdict != "leaks":
            return unjudged(spec.strong, verdict)
        found.leaking = spec.strong
        found.status = f"no setting in the range protects: even {spec.knob}={spec.strong:g} leaks; widen the range"
        return found
    found.protecting = spec.strong
    verdict = judge(spec.weak)
    if verdict in PROTECTING:
        found.protecting = spec.weak
        found.status = (f"every setting in the range protects: even {spec.knob}={spec.weak:g}; widen the range "
                        "towards weaker settings")
        return found
    if verdict != "leaks":
        return unjudged(spec.weak, verdict)
    found.leaking = spec.weak
    while factor(found.leaking, found.protecting) > spec.tolerance and len(found.probes) < spec.probes:
        value = midpoint(spec, found.leaking, found.protecting)
        if value is None:
            break
        verdict = judge(value)
        if verdict in PROTECTING:
            found.protecting = value
        elif verdict == "leaks":
            found.leaking = value
        else:
            return unjudged(value, verdict)
    gap = factor(found.leaking, found.protecting)
    if gap <= spec.tolerance or midpoint(spec, found.leaking, found.protecting) is None:
        found.status = f"bracketed within a factor {gap:.3g} in {len(found.probes)} probes"
    else:
        found.status = (f"the budget of {spec.probes} probes is spent with the bracket a factor {gap:.3g} wide "
                        f"(tolerance {spec.tolerance:g}); raise frontier.probes to narrow it")
    return found
