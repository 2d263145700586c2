"""Helpers for test suites: plugin authors' checks of their defenses and attacks, and a team's
``--fail-on-leak`` gate as a pytest assertion.

::

    from leakaudit.testing import check_attack, check_defense

    def test_my_defense_declares_what_it_sends():
        check_defense(MyDefense(scale=0.1))      # share() against log_likelihood(), on a tiny model

    def test_my_attack_beats_noise():
        check_attack(MyAttack(iterations=200))   # an undefended image, every protocol it does not refuse

    from leakaudit import load_audit, run_audit
    from leakaudit.testing import assert_protects

    def test_our_defense_protects(tmp_path):
        summary = run_audit(load_audit("audits/ci.yaml"), tmp_path / "run", progress=False)
        assert_protects(summary)          # the settings marked must_protect: true
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from leakaudit.evaluator.authoring.attack_check import AttackCheck, check_attack
from leakaudit.evaluator.authoring.cases import tiny_case
from leakaudit.evaluator.authoring.defense_check import DefenseCheck, check_defense
from leakaudit.evaluator.results.types import Summary
from leakaudit.evaluator.results.verdict import GATE_LEVELS, gate_failures
from leakaudit.plugins.spec import did_you_mean

__all__ = ["check_defense", "check_attack", "DefenseCheck", "AttackCheck", "tiny_case", "assert_protects",
           "load_summary"]


def load_summary(run: str | Path | Summary | dict[str, Any]) -> Summary:
    """A run's typed summary, from itself, a run folder, a summary.json path, or that file's mapping."""
    if isinstance(run, Summary):
        return run
    if isinstance(run, dict):
        return Summary.from_json(run)
    path = Path(run)
    path = path / "summary.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no summary.json; run the audit first (leakaudit run FILE --out DIR)")
    return Summary.from_json(json.loads(path.read_text()))


def assert_protects(run: str | Path | Summary | dict[str, Any], settings: Iterable[str] | None = None,
                    allow_inconclusive: bool = False, fail_on: str = "individuals") -> None:
    """Fail, one line per setting, where a checked setting's verdict is ``leaks`` at a level ``fail_on`` takes in
    (``"individuals"``; ``"labels"``: a leak of the classes alone too), or ``inconclusive`` (the attacks did not
    break even the undefended update, unless ``allow_inconclusive``), and where any attack beat the bound of a
    defense's privacy guarantee.

    ``settings`` names the settings to check (their keys in the report); by default, every setting of a
    defense entry marked ``must_protect: true``, as ``leakaudit run --fail-on-leak`` checks.
    """
    summary = load_summary(run)
    if settings is None and not any(w.must_protect for w in summary.worst_case):
        raise AssertionError("no defense entry of this audit is marked must_protect: true; mark one, or "
                             "name the settings to check")
    if settings is not None:
        settings = list(settings)
        known = [w.setting for w in summary.worst_case]
        missing = [s for s in settings if s not in known]
        if missing:
            raise AssertionError(f"not settings of this run: {', '.join(missing)}; settings: {', '.join(known)}")
    if fail_on not in GATE_LEVELS:
        raise ValueError(f"fail_on: {fail_on!r} is not a level{did_you_mean(fail_on, list(GATE_LEVELS))}; "
                         f"choices: {', '.join(GATE_LEVELS)}")
    failures = [f"{kind}: {line}" for kind, line in gate_failures(summary, allow_inconclusive, settings, fail_on)]
    if failures:
        raise AssertionError("\n".join(failures))
