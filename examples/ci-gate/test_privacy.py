"""Our release gate, in our own test suite: the defense we ship must not leak to the strongest attack.

    pytest examples/ci-gate

The same check from the command line, for a CI step (exit status 3 on a leak):

    leakaudit run examples/ci-gate/audit.yaml --out runs/ci-gate --fail-on-leak
"""
from pathlib import Path

import pytest

from leakaudit import load_audit, run_audit
from leakaudit.testing import assert_protects

AUDIT = Path(__file__).with_name("audit.yaml")


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    return run_audit(load_audit(AUDIT), tmp_path_factory.mktemp("ci-gate") / "run", progress=False)


def test_the_shipped_defense_protects(summary):
    assert_protects(summary)  # every setting of an entry marked must_protect: true


def test_the_audit_can_still_see_a_leak(summary):
    """The gate is only worth something if the same attack breaks the undefended model."""
    assert summary.worst("none").verdict == "leaks"
