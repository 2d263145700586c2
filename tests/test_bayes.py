"""The Bayes-optimal adversary uses the defense's own likelihood; l2, l1, cos share its optimiser."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from leakaudit.attacks.bayes import BayesOptimal, CosineMatching, L1Matching, L2Matching, sample_in_ball
from leakaudit.defenses.noise import GaussianNoise
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.run.runner import run_audit
from leakaudit.evaluator.run.scenario import loss_fn
from leakaudit.evaluator.zoo.datasets import load_digits
from leakaudit.evaluator.zoo.metrics import psnr
from leakaudit.evaluator.zoo.models import lenet_zhu
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.protocol import ClientStep

from conftest import ROOT, small_audit


def _case(defense, size=16):
    data = load_digits(image_size=size)
    torch.manual_seed(0)
    model = lenet_zhu(1, 10, size)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    pixels, label = data.test_x[:1], data.test_y[:1]
    observed = defense.share(ClientStep(model, loss_fn, (pixels - mean) / std, label, torch.Generator().manual_seed(1)))
    return observed, ThreatModel(model, loss_fn, (1, size, size), mean, std, 10, 1, defense), pixels


def test_samples_are_uniform_in_the_ball():
    centre = torch.zeros(2, 1, 4, 4)
    points = sample_in_ball(centre, 0.5, 2000, torch.Generator().manual_seed(0))
    radii = points.flatten(2).norm(dim=2)
    assert points.shape == (2000, 2, 1, 4, 4) and radii.max() <= 0.5
    # uniform in a 16-dimensional ball: P(r < 0.5 * 0.9) = 0.9 ** 16
    assert (radii < 0.45).float().mean().item() == pytest.approx(0.9 ** 16, abs=0.03)
    assert torch.equal(sample_in_ball(centre, 0.0, 5, torch.Generator()), centre[None])


def test_bayes_on_gaussian_noise_is_l2_up_to_scale():
    sigma = 0.1
    observed, threat, pixels = _case(GaussianNoise(sigma=sigma))
    l2 = L2Matching(iterations=150, priors={"tv": 1e-3})(observed, threat, torch.Generator().manual_seed(3))
    bayes = BayesOptimal(iterations=150, priors={"tv": 1e-3 / (2 * sigma ** 2)})(
        observed, threat, torch.Generator().manual_seed(3))
    # -log p(g|x) = l2 / (2 sigma^2): with beta scaled alike the objectives are proportional, and Adam is
    # invariant to the scale of its objective, so both runs take the same path
    assert psnr(bayes.images, l2.images).item() > 40.0


@pytest.mark.slow
@pytest.mark.parametrize("cls", [BayesOptimal, L2Matching, L1Matching, CosineMatching])
def test_every_variant_rebuilds_an_undefended_digit(cls):
    from leakaudit.defenses.noise import NoDefense

    observed, threat, pixels = _case(NoDefense())
    rec = cls(iterations=400, lr=0.1, lr_decay=0.1)(observed, threat, torch.Generator().manual_seed(0))
    assert psnr(rec.images, pixels).item() > 18.0 and rec.loss_trace[-1] < rec.loss_trace[0]


@pytest.mark.slow
def test_plugin_defense_gets_its_bayes_attack_for_free(tmp_path, write_audit):
    folder = tmp_path / "dropins"
    folder.mkdir()
    shutil.copy(ROOT / "examples" / "plugin-template" / "src" / "leakaudit_logistic" / "__init__.py",
                folder / "logistic.py")
    audit = small_audit(defenses=[{"name": "logistic", "params": {"scale": 0.001}}],
                        attacks=[{"name": "bayes", "params": {"iterations": 300}}], utility={"train_steps": 0},
                        plugins_dir=str(folder))
    summary = run_audit(load_audit(write_audit(audit)), tmp_path / "out", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert {r["attack"] for r in rows} == {"bayes"} and len(rows) == 4  # and the added undefended reference
    assert {r["setting"] for r in rows} == {"logistic(scale=0.001)", "none"}
    assert summary.cells[0].mean("psnr") > summary.baselines["random"]["psnr"] + 8.0


def test_vectorised_steps_carry_no_graph_of_the_models_parameters():
    """A candidate update built from parameters that require grad (dpsgd's clipped mean does) must not chain each
    step's graph into the next iterate: memory grew by 30 MB a step, and a dpsgd audit was killed for memory."""
    from leakaudit.attacks.vectorised import Batch, optimise

    weight = torch.tensor(2.0, requires_grad=True)  # stands for a model parameter

    def objective(images, labels, targets, metadata, hyper, unknowns):
        return ((weight * images - targets[0]) ** 2).sum()

    k = 3
    target = torch.rand(k, 1, 1, 4, 4)
    batch = Batch([], torch.zeros(k, 1, 1, 4, 4), torch.zeros(k, 1, dtype=torch.long), [target], {}, {},
                  {"lr": torch.full((k,), 0.05)})
    images, _, trace = optimise(batch, objective, iterations=300, lr_factor=lambda it: torch.tensor(1.0),
                                signed=False, box=(torch.tensor(-1.0), torch.tensor(1.0)))
    assert images.grad_fn is None and not images.requires_grad
    assert torch.allclose(images, target / 2, atol=1e-3)  # and it still solves 2x = t
    assert trace[-1].max() < 1e-4


def test_exponential_layer_weights_of_the_distance_attacks_exact():
    import math

    from leakaudit.attacks.bayes import CosineMatching, L1Matching, L2Matching, layer_weights
    from leakaudit.plugins.defense import SharedUpdate

    assert layer_weights("exp", 3) == [1.0, math.exp(-1), math.exp(-2)] and layer_weights("equal", 2) == [1.0, 1.0]
    observed = SharedUpdate([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])], ["w", "b"], 1)
    candidate = [torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])]
    e = math.exp(-1)
    assert L2Matching(layer_weights="exp").negative_log_likelihood(observed, candidate, None).item() == \
        pytest.approx(1.0 + e * 2.0)
    assert L1Matching(layer_weights="exp").negative_log_likelihood(observed, candidate, None).item() == \
        pytest.approx(1.0 + e * 2.0)
    assert L2Matching().negative_log_likelihood(observed, candidate, None).item() == pytest.approx(3.0)
    # weighted cosine: dot = e * 2, |o|^2 = 1 + 4e, |c|^2 = 2e
    cos = CosineMatching(layer_weights="exp").negative_log_likelihood(observed, candidate, None).item()
    assert cos == pytest.approx(1 - 2 * e / math.sqrt((1 + 4 * e) * 2 * e))
    plain = CosineMatching().negative_log_likelihood(observed, candidate, None).item()
    assert plain == pytest.approx(1 - 2 / math.sqrt(5 * 2))
