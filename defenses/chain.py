"""Chains of defenses applied in order (``clip`` then ``gaussian``), with the chain's own likelihood."""
from __future__ import annotations

from typing import Any, Sequence, cast

import torch
from torch import Tensor, nn

from leakaudit.plugins.defense import Defense, DeterministicDefense, SharedUpdate


class Chain(Defense):
    """Applies its members in order; all but the last must be deterministic.

    Then ``p(g | x) = p_last(g | T(g(x)))`` with ``T`` the composed deterministic
    maps, which is exact; a random member before the end would make the chain's
    likelihood an intractable integral, so it is refused.
    """

    name = "chain"

    def __init__(self, members: Sequence[Defense]) -> None:
        super().__init__()
        if len(members) < 2:
            raise ValueError("chain: needs at least two members")
        for m in members:
            if m.shares_itself():
                raise ValueError(f"chain: {m.name!r} computes its update from the model and inputs "
                                 "and cannot be a chain member")
        for i, m in enumerate(members[:-1]):
            if not m.deterministic:
                raise ValueError(f"chain: only the last member may be random; {m.name!r} at position {i} is random")
        self.members = list(members)

    def __repr__(self) -> str:
        return " > ".join(map(repr, self.members))

    def unsupported(self, protocol) -> str | None:
        return next((why for m in self.members if (why := m.unsupported(protocol))), None)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        for m in self.members:
            model = m.wrap_model(model)
            self.model_changes += m.model_changes
        return model

    def client_loss(self, model: nn.Module, loss_fn):
        for m in self.members:
            loss_fn = m.client_loss(model, loss_fn)
        return loss_fn

    def augment(self, pixels: Tensor, generator: torch.Generator) -> Tensor:
        for m in self.members:
            pixels = m.augment(pixels, generator)
        return pixels

    def defended_tensors(self, names) -> set[str]:
        return set().union(*(m.defended_tensors(names) for m in self.members))

    def apply(self, update: list[Tensor], generator: torch.Generator) -> tuple[list[Tensor], dict[str, Any]]:
        public: dict[str, Any] = {}
        for m in self.members:
            update, meta = m.apply(update, generator)
            public.update(meta)
        return update, public

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        for m in self.members[:-1]:  # deterministic members: a chain's check made sure
            candidate = cast(DeterministicDefense, m).transform(candidate)
        return self.members[-1].log_likelihood(observed, candidate)

    def has_likelihood(self) -> bool:
        return self.members[-1].has_likelihood()

    @property
    def bounded_support(self) -> bool:  # type: ignore[override]
        return self.members[-1].bounded_support

    @property
    def sparsifies(self) -> bool:  # type: ignore[override]
        """A chain sparsifies where a member does: each client then runs the whole chain on its own update."""
        return any(m.sparsifies for m in self.members)

    def privacy_spent(self, steps: int, sample_rate: float, delta: float) -> float | None:
        return self.members[-1].privacy_spent(steps, sample_rate, delta)

    def stated_over(self, rounds: int) -> Defense:
        """The chain with its last member's guarantee stated over ``rounds`` releases."""
        last = self.members[-1].stated_over(rounds)
        return self if last is self.members[-1] else Chain([*self.members[:-1], last])

    def under(self, protocol) -> Defense:
        """The chain with each member as it runs under ``protocol``."""
        members = [m.under(protocol) for m in self.members]
        return self if all(a is b for a, b in zip(members, self.members)) else Chain(members)

    def privacy_profile(self, radius: float | None = None):
        """The last member's guarantee, given the norm bound the deterministic members before it leave."""
        for m in self.members[:-1]:  # a member that bounds nothing (or declares no output_radius) clears the bound
            radius = getattr(m, "output_radius", lambda _: None)(radius)
        return self.members[-1].privacy_profile(radius)
