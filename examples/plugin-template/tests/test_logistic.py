"""The logistic defense: its likelihood describes what it sends, and leakaudit finds it and audits with it."""
import pytest

from leakaudit import load_audit, load_registry
from leakaudit.evaluator.cli import main
from leakaudit.testing import check_defense

from leakaudit_logistic import LogisticDefense


@pytest.mark.parametrize("scale", [0.01, 1.0])
def test_likelihood_matches_what_is_sent(scale):
    check_defense(LogisticDefense(scale=scale))


def test_a_likelihood_of_the_wrong_scale_is_caught():
    class TooFlat(LogisticDefense):
        def log_likelihood(self, observed, candidate):
            return LogisticDefense(scale=2 * self.scale).log_likelihood(observed, candidate)

    with pytest.raises(AssertionError, match="flatter than what share"):
        check_defense(TooFlat(scale=0.1))


def test_registered_through_the_entry_point():
    assert load_registry().entries["defense"]["logistic"].origin.startswith("entrypoint:logistic ")


def test_an_audit_file_uses_it(tmp_path):
    path = tmp_path / "audit.yaml"
    assert main(["init", str(path), "--defense", "logistic"]) == 0
    assert "logistic(scale=0.1)" in [s.key for s in load_audit(path).settings]
