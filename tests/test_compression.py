"""Compression as a defense: signSGD (Bernstein et al. 2018) and QSGD (Alistarh et al. 2017), what they send,
their likelihoods, and what knowing them buys."""
from __future__ import annotations

import pytest
import torch

from leakaudit.defenses.compression import QSGD, SignSGD, log_kernel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.manager import load_registry
from leakaudit.testing import check_defense


def _sent(defense: SignSGD, update: list[torch.Tensor]) -> SharedUpdate:
    return SharedUpdate(defense.perturb(update, torch.Generator()), ["w", "b"], 1, {})


def test_signsgd_sends_signs_scaled_by_each_tensors_mean_magnitude():
    update = [torch.tensor([[0.5, -1.5], [0.0, 2.0]]), torch.tensor([-3.0])]
    scaled, plain = SignSGD().perturb(update, torch.Generator()), SignSGD(scaled=False).perturb(update, torch.Generator())
    assert torch.equal(scaled[0], torch.tensor([[1.0, -1.0], [0.0, 1.0]]))  # mean |g| = 1
    assert torch.equal(scaled[1], torch.tensor([-3.0]))
    assert torch.equal(plain[0], torch.tensor([[1.0, -1.0], [0.0, 1.0]])) and torch.equal(plain[1], torch.tensor([-1.0]))


def test_the_likelihood_is_highest_exactly_where_the_candidate_sends_the_same():
    update = [torch.tensor([[0.5, -1.5], [0.0, 2.0]]), torch.tensor([-3.0])]
    for defense in (SignSGD(), SignSGD(scaled=False)):
        observed = _sent(defense, update)
        assert float(defense.log_likelihood(observed, update)) == 0.0
    plain = SignSGD(scaled=False)
    observed = _sent(plain, update)
    flipped = [torch.tensor([[0.5, 0.25], [0.0, 2.0]]), torch.tensor([-3.0])]  # one sign flipped, 0.25 past zero
    assert float(plain.log_likelihood(observed, flipped)) == pytest.approx(-0.5 * 0.25 ** 2)
    moved_zero = [torch.tensor([[0.5, -1.5], [0.1, 2.0]]), torch.tensor([-3.0])]  # a zero coordinate made 0.1
    assert float(plain.log_likelihood(observed, moved_zero)) == pytest.approx(-0.5 * 0.1 ** 2)
    scaled = SignSGD()
    larger = [2 * t for t in update]  # the same signs, twice the scale: mean |g| of the first tensor 2, not 1
    assert float(scaled.log_likelihood(_sent(scaled, update), larger)) == pytest.approx(-0.5 * (4 + 1 * 9))


@pytest.mark.slow
def test_unscaled_signsgd_passes_the_plugin_check():
    """(The scaled default is checked with every built-in in tests/test_checks.py.)"""
    assert check_defense(SignSGD(scaled=False)).kind == "exact"


def test_signsgd_is_registered_with_its_paper():
    registry = load_registry(entry_points=False)
    assert registry.get("defense", "signsgd") is SignSGD and SignSGD.paper == "Bernstein et al. 2018"


@pytest.mark.heavy
def test_the_bayes_adversary_reads_more_of_each_compressor_than_inverting_gradients(write_audit, tmp_path):
    """configs/compression.yaml's attacks on 4 digits at step 0, signSGD and QSGD at 4 levels: the attacker who
    knows the compression (signed steps, its prior's weight tuned on its own images) rebuilds better images than
    the one matching cosines (measured 13.6 against 8.75 dB and 13.4 against 8.0 dB on 2 cores)."""
    import yaml

    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.runner import run_audit

    from conftest import ROOT

    audit = yaml.safe_load((ROOT / "configs" / "compression.yaml").read_text())
    audit |= {"defenses": [{"name": "signsgd"}, {"name": "qsgd", "params": {"levels": 4}, "label": "qsgd4"}],
              "utility": {"train_steps": 0}, "workers": 1, "device": "cpu"}
    summary = run_audit(load_audit(write_audit(audit)), tmp_path / "out", progress=False)
    for setting in ("signsgd", "qsgd4"):
        psnr = {c.attack: c.mean("psnr") for c in summary.cells if c.setting == setting}
        assert psnr["bayes"] > psnr["inverting_gradients"] + 2.0, (setting, psnr)


def test_qsgd_sends_each_tensor_on_its_norms_lattice_and_unbiased():
    update = [torch.tensor([0.3, -0.4, 0.0, 1.2]), torch.tensor([[2.0, -1.0]])]
    defense, draws = QSGD(levels=4), 4000
    sent = [defense.apply(update, torch.Generator().manual_seed(i)) for i in range(draws)]
    norms = sent[0][1]["norms"]
    assert [float(n) for n in norms] == pytest.approx([1.3, 5 ** 0.5])
    for k, (g, norm) in enumerate(zip(update, norms)):
        values = torch.stack([s[k] for s, _ in sent])
        levels = values * 4 / norm
        assert torch.allclose(levels, levels.round(), atol=1e-5)  # on the lattice of step norm / 4
        assert ((levels - 4 * g / norm).abs() < 1 + 1e-5).all()  # one of the two levels around the coordinate
        assert (values[:, g == 0] == 0).all()
        step = norm / 4  # the variance of a coordinate a fraction f past its lower level: step^2 f (1 - f)
        frac = (g.abs() / step) % 1
        tolerance = 4 * (step ** 2 * frac * (1 - frac) / draws).sqrt() + 1e-6
        assert ((values.mean(0) - g).abs() <= tolerance).all()


def test_qsgd_likelihood_is_the_triangle_around_what_was_sent():
    defense = QSGD(levels=2)
    update = [torch.tensor([0.6, -0.8])]  # norm 1, step 0.5: 0.6 lies 0.2 past the level 0.5
    observed = SharedUpdate([torch.tensor([0.5, -1.0])], ["w"], 1, {"norms": [torch.tensor(1.0)]})
    expected = torch.log(torch.tensor(1 - 0.1 / 0.5)) + torch.log(torch.tensor(1 - 0.2 / 0.5))
    assert float(defense.log_likelihood(observed, update)) == pytest.approx(float(expected))
    outside = [torch.tensor([1.2, -0.8], requires_grad=True)]  # 0.7 from 0.5: past the triangle's half-width
    value = defense.log_likelihood(observed, outside)
    value.backward()
    assert torch.isfinite(value) and float(value) < float(expected) - 100
    assert float(outside[0].grad[0]) < 0  # the slope leads back into the support


def test_log_kernel_continues_log_by_its_tangent():
    value = torch.tensor([0.5, 1e-3, 5e-4, -1.0], dtype=torch.float64)
    assert log_kernel(value).tolist() == pytest.approx([torch.log(torch.tensor(0.5)).item(), -6.907755, -7.407755,
                                                        -6.907755 - 1 - 1000], rel=1e-6)


@pytest.mark.slow
def test_a_qsgd_likelihood_of_the_wrong_width_fails_the_plugin_check():
    class Wide(QSGD):
        def log_likelihood(self, observed, candidate):
            doubled = {"norms": [2 * n for n in observed.metadata["norms"]]}
            return super().log_likelihood(SharedUpdate(observed.tensors, observed.names, 1, doubled), candidate)

    with pytest.raises(AssertionError, match="flatter than what share"):
        check_defense(Wide(levels=4))


def test_qsgd_is_registered_with_its_paper():
    registry = load_registry(entry_points=False)
    assert registry.get("defense", "qsgd") is QSGD and QSGD.paper == "Alistarh et al. 2017"


@pytest.mark.slow
def test_qsgd_after_clip_in_a_chain_takes_the_autograd_check():
    from leakaudit.defenses.chain import Chain
    from leakaudit.defenses.clipping import Clip

    check = check_defense(Chain([Clip(max_norm=0.5), QSGD(levels=4)]), shares=128, directions=16)
    assert check.kind == "noisy" and 0.85 < check.scale_ratio < 1.15
