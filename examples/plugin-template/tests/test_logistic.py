"""The logistic defense: its likelihood describes what it sends, and leakaudit finds it."""
import pytest

from leakaudit import load_registry
from leakaudit.testing import check_defense

from leakaudit_logistic import LogisticNoise


@pytest.mark.parametrize("scale", [0.01, 1.0])
def test_likelihood_matches_what_is_sent(scale):
    check = check_defense(LogisticNoise(scale=scale))
    assert check.kind == "noisy"


def test_a_laplace_declared_for_logistic_noise_is_caught():
    class DeclaresLaplace(LogisticNoise):
        def log_likelihood(self, observed, candidate):
            return sum((-(o - c).abs() / self.scale).sum() for o, c in zip(observed.tensors, candidate))

    with pytest.raises(AssertionError, match="sharper than what share"):
        check_defense(DeclaresLaplace(scale=0.1))


def test_registered_through_the_entry_point():
    assert load_registry().entries["defense"]["logistic"].origin == "entrypoint:logistic (leakaudit-logistic)"
