"""``compile: true``: the vectorised steps through torch.compile give what the eager steps give, for each model."""
from __future__ import annotations

import torch

from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.attacks.vectorised import compile_steps
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.zoo.models import lenet_zhu

from test_isolation import problems_on


def _solve(models: list[torch.nn.Module], compiled: bool) -> list[torch.Tensor]:
    restore = compile_steps(compiled)
    try:
        attack = InvertingGradients(iterations=20, restarts=1)
        return [r.images for m in models for r in InvertingGradients.reconstruct_all(problems_on(NoDefense(), m, attack))]
    finally:
        restore()


def test_compiled_steps_follow_the_eager_ones_and_each_chunks_own_weights(monkeypatch):
    compiled_functions = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled_functions.append(fn) or real(fn, **kw))
    torch.manual_seed(0)
    models = [lenet_zhu(1, 10, 16), lenet_zhu(1, 10, 16)]  # one shape, other weights: the second chunk reuses the
    eager = _solve(models, False)  # compiled step, and must read its own weights
    assert not compiled_functions  # only when asked
    compiled = _solve(models, True)
    assert len(compiled_functions) >= 2  # at least one vectorised step per chunk
    assert not torch.allclose(eager[0], eager[3], atol=1e-2)  # the two models' reconstructions differ
    for a, b in zip(eager, compiled):
        assert (a - b).abs().max() < 1e-3, float((a - b).abs().max())
