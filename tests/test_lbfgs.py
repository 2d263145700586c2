"""BatchedLBFGS: many problems' L-BFGS runs with shared passes must take the steps torch.optim.LBFGS takes alone."""
from __future__ import annotations

import pytest
import torch

from leakaudit.attacks import vectorised
from leakaudit.attacks.gradient_matching import MAX_BATCHED_PROBLEMS, DeepLeakage, history_cap
from leakaudit.attacks.lbfgs import BatchedLBFGS, Direction, LBFGSSettings, minimise
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.zoo.models import lenet_zhu

from test_isolation import problems_on

PROBLEMS, SIZE, STEPS = 5, 6, 4


def _objectives():
    """Five smooth non-quadratic problems: a random convex quadratic plus a Rosenbrock chain."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(PROBLEMS, SIZE, SIZE, generator=gen, dtype=torch.float64)
    a = a @ a.transpose(1, 2) + 0.1 * torch.eye(SIZE, dtype=torch.float64)
    b = torch.randn(PROBLEMS, SIZE, generator=gen, dtype=torch.float64)
    starts = torch.randn(PROBLEMS, SIZE, generator=gen, dtype=torch.float64)

    def f(x, k):
        return 0.5 * x @ a[k] @ x - b[k] @ x + ((x[1:] - x[:-1] ** 2) ** 2).sum()

    return f, starts


@pytest.mark.parametrize("line_search,lr", [(True, 1.0), (False, 0.1)])
def test_each_problem_takes_the_steps_torch_lbfgs_takes_alone(line_search, lr):
    """A history of 3 pairs over 4 steps of up to 20 iterations: windows fill, drop their oldest pair and rewind."""
    f, starts = _objectives()
    settings = LBFGSSettings(lr=lr, line_search=line_search, history_size=3)
    asked = []

    def evaluate(rows, x):
        asked.append(len(rows))
        x = x.detach().requires_grad_(True)
        loss = torch.stack([f(x[j], k) for j, k in enumerate(rows)])
        return loss.detach(), torch.autograd.grad(loss.sum(), x)[0]

    engine = BatchedLBFGS(evaluate, PROBLEMS, SIZE, 3, torch.device("cpu"), torch.float64)
    together = engine.run([minimise(starts[k].clone(), STEPS, settings) for k in range(PROBLEMS)])
    assert max(asked) == PROBLEMS  # the evaluations were batched
    for k, (x, losses) in enumerate(together):
        alone = starts[k].clone().requires_grad_(True)
        optimiser = torch.optim.LBFGS([alone], lr=lr, history_size=3,
                                      line_search_fn="strong_wolfe" if line_search else None)

        def closure():
            optimiser.zero_grad()
            loss = f(alone, k)
            loss.backward()
            return loss

        expected = [optimiser.step(closure).item() for _ in range(STEPS)]
        assert losses == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert torch.allclose(x, alone.detach(), rtol=1e-9, atol=1e-12)
        assert losses[-1] < losses[0]


def test_a_run_that_restarts_clears_its_history_and_a_zero_loss_stops_it():
    """Each restart begins as steepest descent (a fresh torch.optim.LBFGS); a problem already at its minimum stops."""
    f, starts = _objectives()
    settings = LBFGSSettings(history_size=4)

    def evaluate(rows, x):
        x = x.detach().requires_grad_(True)
        loss = torch.stack([(x[j] ** 2).sum() if k == 1 else f(x[j], k) for j, k in enumerate(rows)])
        return loss.detach(), torch.autograd.grad(loss.sum(), x)[0]

    def twice(start):
        x, first = yield from minimise(start, 2, settings)
        x, second = yield from minimise(x, 2, settings)
        return x, first + second

    engine = BatchedLBFGS(evaluate, 2, SIZE, 4, torch.device("cpu"), torch.float64)
    restarted, at_zero = engine.run([twice(starts[0].clone()), twice(torch.zeros(SIZE, dtype=torch.float64))])
    assert at_zero[1] == [0.0, 0.0]  # each run stops at its first step's zero loss
    alone = starts[0].clone().requires_grad_(True)
    for _ in range(2):  # a new optimiser each run: its history starts empty
        optimiser = torch.optim.LBFGS([alone], history_size=4, line_search_fn="strong_wolfe")

        def closure():
            optimiser.zero_grad()
            loss = f(alone, 0)
            loss.backward()
            return loss

        for _ in range(2):
            optimiser.step(closure)
    assert torch.allclose(restarted[0], alone.detach(), rtol=1e-9, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("attack,known", [(DeepLeakage(iterations=6, restarts=2), False),
                                          pytest.param(DeepLeakage(iterations=6, line_search=False), True,
                                                       marks=pytest.mark.heavy)])
def test_dlg_batched_agrees_with_the_lock_step_reference(attack, known):
    """The same problems through BatchedLBFGS and through torch.optim.LBFGS per problem (LockStep)."""
    model = lenet_zhu(1, 10, 16)
    batched = DeepLeakage.reconstruct_all(problems_on(NoDefense(), model, attack, known))
    reference, solve = DeepLeakage._batch(problems_on(NoDefense(), model, attack, known), lock_step=True)
    for a, b in zip(solve(reference), batched):  # batched passes round differently: paths part by a few 1e-3
        gap = (a.images - b.images).abs()
        assert gap.mean() < 2e-3 and gap.max() < 5e-2 and torch.equal(a.labels, b.labels)
        assert len(a.loss_trace) == len(b.loss_trace)
        assert b.extras["match_loss"] == pytest.approx(a.extras["match_loss"], rel=0.5, abs=1e-4)


def test_a_restart_forgets_a_stored_pair_that_overflowed():
    """torch.optim.LBFGS stores a pair whose y overflowed (y . s = inf > 0); a new optimiser forgets it, and so
    must a restarted problem here: its first direction is -grad, not NaN."""
    g = torch.tensor([1.0, -2.0, 0.5])

    def solver():
        first = yield Direction(g, True)
        yield Direction(torch.tensor([float("inf"), 1.0, 1.0]), False, g, first.d, 1.0)
        again = yield Direction(2 * g, True)
        return again.d

    (d,) = BatchedLBFGS(lambda rows, x: None, 1, 3, 2, torch.device("cpu")).run([solver()])
    assert torch.equal(d, -2 * g)


def test_the_histories_of_a_chunk_fit_in_free_memory(monkeypatch):
    """Each dlg problem on 16 px digits with known labels keeps 2 x 100 pairs of (s, y) over 16 x 16 pixels: 409,600
    bytes in float32 (10 more values a pair where the labels are unknown). With room for two histories in the quarter
    of free memory they may use, a chunk holds two."""
    model = lenet_zhu(1, 10, 16)
    problems = problems_on(NoDefense(), model, DeepLeakage(iterations=1))
    history = 2 * 100 * 2 * 16 * 16 * 4
    monkeypatch.setattr(vectorised, "free_memory", lambda device: 4 * (2 * history + 1))
    assert history_cap(problems, None) == 2
    unknown = problems_on(NoDefense(), model, DeepLeakage(iterations=1), known_labels=False)
    assert history_cap(unknown, None) == 1  # 266 values a pair: two no longer fit
    assert history_cap(problems, 64) == MAX_BATCHED_PROBLEMS  # a number given is the user's to answer for
    monkeypatch.setattr(vectorised, "free_memory", lambda device: 1 << 40)
    assert history_cap(problems, None) == MAX_BATCHED_PROBLEMS
