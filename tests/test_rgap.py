"""rgap and hybrid (Chen & Campbell 2022): exact where the metric is 0, hybrid below rgap where it is not (Appendix E)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leakaudit.attacks.linear_system import ConvSystem, _cgls, _dense_min_norm, conv_systems
from leakaudit.attacks.rgap import HybridInversion, LayerwiseInversion
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.zoo.models import LINEAR_SYSTEM_VARIANTS, lenet_zhu, linear_system_cnn, mlp
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.protocol import FEDSGD, ClientStep


def case(name: str, size: int, index: int = 0):
    from leakaudit.plugins.manager import load_registry

    data = load_registry().get("dataset", "cifar10_samples").load(image_size=size, root=None, download=False)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    torch.manual_seed(0)
    model = linear_system_cnn(3, 10, size, LINEAR_SYSTEM_VARIANTS[name])
    pixels, label = data.test_x[index:index + 1], data.test_y[index:index + 1]
    observed = NoDefense().share(ClientStep(model, F.cross_entropy, (pixels - mean) / std, label, torch.Generator()))
    threat = ThreatModel(model, F.cross_entropy, (3, size, size), mean, std, 10, 1, NoDefense())
    return observed, threat, pixels


def psnr(a, b):
    return float(-10 * torch.log10(((a - b) ** 2).mean()))


@pytest.mark.parametrize("name, solver", [("cnn2_v1", {}), ("cnn3_v3", {}), ("cnn2_v1", {"dense_limit": 1})])
def test_rgap_rebuilds_the_image_exactly_where_the_metric_is_zero(name, solver):
    """Dense pseudo-inverse, and matrix-free conjugate gradients (``dense_limit: 1``)."""
    observed, threat, pixels = case(name, 16)
    rec = LayerwiseInversion(**solver)(observed, threat, torch.Generator())
    assert psnr(rec.images, pixels) > 60


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn2_v2", "cnn3_v2"])
def test_hybrid_improves_on_rgap_where_the_system_is_rank_deficient(name):
    """Chen & Campbell 2022, Appendix E: MSE 0.0051 against 0.0346 (CNN2 V2) and 0.0322 against 0.0518 (CNN3 V2)."""
    observed, threat, pixels = case(name, 32)
    rgap = LayerwiseInversion()(observed, threat, torch.Generator())
    hybrid = HybridInversion(iterations=400)(observed, threat, torch.Generator())
    mse_rgap = float(((rgap.images - pixels) ** 2).mean())
    mse_hybrid = float(((hybrid.images - pixels) ** 2).mean())
    assert mse_hybrid < 0.9 * mse_rgap, (mse_hybrid, mse_rgap)


def test_hybrid_takes_appendix_d_settings_per_convolution_from_the_input():
    """Chen & Campbell 2022, Appendix D: 10000 / 8000 / 1000 steps for the first, second and other convolutions."""
    hybrid = HybridInversion()
    assert [hybrid.setting("iterations", k) for k in range(4)] == [10000, 8000, 1000, 1000]
    assert [hybrid.setting("system_weight", k) for k in range(3)] == [0.05, 0.1, 1.0]
    assert [hybrid.setting("cosine_weight", k) for k in range(3)] == [1.0, 1.0, 10.0]
    assert hybrid.cosine == "per_tensor" and HybridInversion(tv=0.3).setting("tv", 5) == 0.3
    observed, threat, pixels = case("cnn3_v2", 16)
    steps = HybridInversion(iterations=[7, 3, 1]).reconstruct(observed, threat, torch.Generator()).loss_trace
    assert len(steps) == 7 + 3  # two convolutions: the first's steps, then the second's


@pytest.mark.slow
def test_matrix_free_conjugate_gradients_reach_the_dense_minimum_norm_solution():
    model = linear_system_cnn(3, 10, 12, LINEAR_SYSTEM_VARIANTS["cnn3_v2"]).double()
    (first, second) = conv_systems(model, F.cross_entropy, torch.rand(1, 3, 12, 12, dtype=torch.float64),
                                   torch.tensor([1]))
    for system in (first, second):  # under- and over-determined
        dense = _dense_min_norm(system.matrix, system.rhs)
        torch.testing.assert_close(_cgls(system, 2000), dense, rtol=1e-5, atol=1e-6)
        assert isinstance(system, ConvSystem)


def test_rgap_says_where_it_does_not_apply():
    assert "ReLU is not invertible" in LayerwiseInversion().unsupported(
        mlp(3, 10, 8), 1, FEDSGD)
    assert LayerwiseInversion().unsupported(lenet_zhu(3, 10, 16), 1, FEDSGD) is None
    assert "one image" in LayerwiseInversion().unsupported(lenet_zhu(3, 10, 16), 2, FEDSGD)


def test_bad_hybrid_settings_and_models_fail_before_work(write_audit, capsys):
    from leakaudit.evaluator.cli import main

    from conftest import small_audit

    for params, why in (({"tv": -1.0}, "tv: -1.0 is below the minimum 0.0"),
                        ({"tv": [0.1, -1.0, 0.0]}, "tv[1]: -1.0 is below the minimum 0.0"),
                        ({"iterations": [10, 10]}, "iterations: [10, 10] is not one value or a list of 3"),
                        ({"iterations": [10, 1.5, 10]}, "iterations[1]: 1.5 is not of type int"),
                        ({"cosine_weight": -1}, "cosine_weight: -1 is below the minimum 0.0"),
                        ({"system_weight": [1, 1, "x"]}, "system_weight[2]: 'x' is not of type float"),
                        ({"cosine": "l2"}, "cosine: 'l2' is not one of the choices; choices: per_tensor, joint")):
        path = write_audit(small_audit(attacks=[{"name": "hybrid", "params": params}]))
        assert main(["validate", str(path)]) == 2
        assert capsys.readouterr().err.strip() == f"leakaudit: error: {path}: attacks[0].params.{why}"
    path = write_audit(small_audit(model={"name": "mlp"}, attacks=[{"name": "rgap"}]))
    assert main(["validate", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"leakaudit: error: {path}: attacks[0]: rgap: layer 2: ReLU is not invertible (tanh, sigmoid, leaky ReLU "
        "and identity are)")
