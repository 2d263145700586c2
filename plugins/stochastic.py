"""Layers that draw fresh noise every forward pass (PRECODE's bottleneck, Bayesian layers).

A ``StochasticModule`` draws from ``self.generator`` (the global RNG when None) and keeps what
the KL term of its last forward pass needs, so the client's loss can add it however the forward
ran (plainly or under ``torch.func.functional_call``); the term itself is computed only when a
loss asks for it (``last_kl``). The helpers here let the evaluator seed that noise per round and
let a defense add the KL terms to the task loss.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from leakaudit.plugins.protocol import LossFn


class StochasticModule(nn.Module):
    """Base of layers with per-forward noise: ``generator`` seeds it, ``last_kl`` is the last pass's KL term."""

    def __init__(self) -> None:
        super().__init__()
        self.generator: torch.Generator | None = None
        self._kl_term: Callable[[], Tensor] | None = None  # set by forward, from that pass's tensors

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the last forward's graph and the generator (per-round state)."""
        state = dict(self.__dict__)
        state.update(generator=None, _kl_term=None)
        return state

    @property
    def draws_noise(self) -> bool:
        """Whether a forward pass draws noise now; False when the draw is pinned to a known value, so that the
        forward is a pure function of its inputs, parameters and buffers."""
        return True

    @property
    def last_kl(self) -> Tensor:
        """The KL term of the last forward pass, differentiable in the tensors that pass used."""
        if self._kl_term is None:
            raise RuntimeError(f"{type(self).__name__}: no forward pass yet, so no KL term")
        return self._kl_term()

    def standard_normal(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """N(0, 1) noise of ``shape`` on ``like``'s device, from this module's generator."""
        return torch.randn(shape, generator=self.generator, device=like.device, dtype=like.dtype)


def stochastic_modules(model: nn.Module) -> list[StochasticModule]:
    return [m for m in model.modules() if isinstance(m, StochasticModule)]


@contextmanager
def noise_from(model: nn.Module, generator: torch.Generator | None) -> Iterator[None]:
    """Every stochastic layer of ``model`` draws from ``generator`` inside the block (restored after)."""
    modules = stochastic_modules(model)
    saved = [m.generator for m in modules]
    for m in modules:
        m.generator = generator
    try:
        yield
    finally:
        for m, g in zip(modules, saved):
            m.generator = g


def with_kl(model: nn.Module, loss_fn: LossFn, weight: float) -> LossFn:
    """``loss_fn`` plus ``weight`` times the KL terms the model's stochastic layers recorded on this forward."""
    if weight == 0:
        return loss_fn
    modules = stochastic_modules(model)

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return loss_fn(logits, targets) + weight * sum(m.last_kl for m in modules)

    return loss
