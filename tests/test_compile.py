"""``compile: true``: the vectorised steps through torch.compile give what the eager steps give, for each model,
compiled once for a model shape and reused by the next chunk with its own weights."""
from __future__ import annotations

import pytest
import torch

from leakaudit.attacks.bayesian import BayesianNoiseKL
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.attacks.vectorised import RECOMPILE_LIMIT, autocast_steps, compile_steps
from leakaudit.defenses.bayesian import Bayesian, bayesian_layers
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.zoo.models import lenet_zhu, mlp

from test_isolation import problems_on


def _strict() -> None:
    """A step the compiler fails on raises here (an audit runs it eagerly: a test would then compare eager to eager)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.suppress_errors = False


def _solve(model: torch.nn.Module, compiled: bool, cuda_graphs: bool = False, strict: bool = True) -> list[torch.Tensor]:
    restore = compile_steps(compiled, cuda_graphs)
    if strict:
        _strict()
    try:
        # plain Adam: a near-zero gradient's sign, which another kernel's rounding can flip, would part the two
        # optimisations by a whole step
        attack = InvertingGradients(iterations=20, restarts=1, signed=False)
        return [r.images for r in InvertingGradients.reconstruct_all(problems_on(NoDefense(), model, attack))]
    finally:
        restore()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_steps_follow_the_eager_ones_and_each_chunks_own_weights():
    torch.manual_seed(0)
    first, second = lenet_zhu(1, 10, 16), lenet_zhu(1, 10, 16)  # one shape, other weights
    eager = [_solve(first, False), _solve(second, False)]
    before = _graphs()
    compiled = [_solve(first, True)]
    made = _graphs() - before
    compiled.append(_solve(second, True))
    assert made >= 1 and _graphs() - before == made  # the second model's chunk ran the first one's compiled step
    assert not torch.allclose(eager[0][0], eager[1][0], atol=1e-2)  # and read its own weights:
    for a, b in zip(eager[0] + eager[1], compiled[0] + compiled[1]):
        assert (a - b).abs().max() < 1e-3, float((a - b).abs().max())


def test_compiling_raises_torchs_limit_on_compilations_and_restores_it():
    import torch._dynamo.config as dynamo_config

    limit = dynamo_config.recompile_limit
    restore = compile_steps(True)
    assert dynamo_config.recompile_limit == max(limit, RECOMPILE_LIMIT)
    restore()
    assert dynamo_config.recompile_limit == limit


@pytest.mark.slow
def test_the_cuda_graph_path_compiles_whole_iterations_in_reduce_overhead_mode_and_follows_eager(monkeypatch):
    """On CUDA a compiled iteration is captured as a CUDA graph (torch.compile's "reduce-overhead") and its outputs
    are copied out of the graph's memory before the next replay. On a CPU the mode compiles without graphs, so the
    same code path runs here and must give the eager numbers."""
    from leakaudit.attacks import vectorised

    modes = []
    compile_ = torch.compile

    def recording(fn, **kwargs):
        modes.append(kwargs.get("mode"))
        return compile_(fn, **kwargs)

    monkeypatch.setattr(vectorised.torch, "compile", recording)
    torch.manual_seed(0)
    model = lenet_zhu(1, 10, 16)
    eager = _solve(model, False)
    assert modes == []
    graphed = _solve(model, True, cuda_graphs=True)
    assert modes == ["reduce-overhead"]
    _solve(model, True)
    assert modes == ["reduce-overhead", None]  # compiled without graphs elsewhere
    for a, b in zip(eager, graphed):
        assert (a - b).abs().max() < 1e-3, float((a - b).abs().max())


@pytest.mark.slow
def test_bayesian_kl_compiles_with_its_noise_given_and_follows_eager():
    """The Bayesian layers' noise is an unknown given to them per problem; their KL term, set by each forward pass,
    must not carry torch.func's wrapped tensors out of the compiled step (torch 2.14 refused to compile it)."""
    defense = Bayesian(layers="all")
    torch.manual_seed(0)
    model = defense.wrap_model(mlp(1, 10, 16, width=8, depth=1))
    attack = BayesianNoiseKL(iterations=10, restarts=1, signed=False)
    runs = []
    for compiled in (False, True):
        restore = compile_steps(compiled)
        _strict()
        try:
            runs.append(BayesianNoiseKL.reconstruct_all(problems_on(defense, model, attack)))
        finally:
            restore()
    for eager, compiled in zip(*runs):
        assert (eager.images - compiled.images).abs().max() < 1e-3
        for a, b in zip(eager.extras["noise"]["1"], compiled.extras["noise"]["1"]):
            assert (a - b).abs().max() < 1e-3
    assert all(layer._kl_term is None for layer in bayesian_layers(model).values())


def test_bfloat16_runs_the_model_passes_under_autocast_and_keeps_the_match():
    """``precision: bfloat16``: the iterations' model passes round to bfloat16 (the images move), the images and the
    final match stay float32 and close to float32's; one problem alone takes the vectorised path too."""
    torch.manual_seed(0)
    model = lenet_zhu(1, 10, 16)
    attack = InvertingGradients(iterations=20, restarts=1, signed=False)
    runs = []
    for precision in ("float32", "bfloat16"):
        restore = autocast_steps(precision)
        try:
            runs.append(InvertingGradients.reconstruct_all(problems_on(NoDefense(), model, attack)[:1]))
        finally:
            restore()
    (full,), (half,) = runs
    assert half.images.dtype == torch.float32 and 1e-4 < (full.images - half.images).abs().max() < 0.5
    assert abs(full.extras["match_loss"] - half.extras["match_loss"]) < 0.05


@pytest.mark.slow
def test_a_step_the_compiler_fails_on_runs_eagerly_and_the_setting_is_restored(monkeypatch):
    """A compiler bug (torch 2.11's inductor on bayesian_kl's VB-ResNet-18 step) costs the speed-up, not the audit."""
    import torch._dynamo.config as dynamo_config
    from leakaudit.attacks import vectorised

    def failing(graph, inputs):
        raise AssertionError("the compiler's own bug")

    compile_ = torch.compile
    monkeypatch.setattr(vectorised.torch, "compile", lambda fn, **kwargs: compile_(fn, backend=failing, dynamic=False))
    torch.manual_seed(0)
    model = lenet_zhu(1, 10, 16)
    eager = _solve(model, False)
    torch._dynamo.reset()
    failed = _solve(model, True, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(eager, failed))
    assert dynamo_config.suppress_errors is False
