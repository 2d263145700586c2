"""The ``Defense`` contract: how a defended update is shared and how likely it is under a candidate."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch
from torch import Tensor, nn

from evaluator.protocol import ClientStep, parameter_names
from plugins.spec import Param, resolve_params


@dataclass
class SharedUpdate:
    """Exactly what leaves the client: one tensor per trainable parameter, plus public metadata."""

    tensors: list[Tensor]
    names: list[str]
    batch_size: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def flat(self) -> Tensor:
        return torch.cat([t.reshape(-1) for t in self.tensors])


class Defense:
    """Base class: subclasses set ``name``, ``params`` and override what their defense changes.

    Gradient-space defenses override ``perturb`` (and ``log_likelihood``);
    architectural ones override ``wrap_model``. ``params`` declares the YAML
    parameters, checked before any work starts; resolved values are attributes.
    """

    name: ClassVar[str]
    params: ClassVar[dict[str, Param]] = {}

    def __init__(self, **settings: Any) -> None:
        self.settings = resolve_params(self.params, settings, self.name)
        for key, value in self.settings.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return f"{type(self).__name__}({args})"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Change the architecture before training (identity for gradient-space defenses)."""
        return model

    def share(self, step: ClientStep) -> SharedUpdate:
        """The defended update the client sends for this step."""
        clean = step.clean_update()
        sent = self.perturb(clean, step.generator)
        return SharedUpdate(sent, parameter_names(step.model), len(step.inputs))

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        """Map the clean update to the sent one, drawing all randomness from ``generator``."""
        return update

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """``log p(observed | candidate)`` up to a constant, differentiable in ``candidate``.

        ``candidate`` is the clean update that a candidate input would produce.
        """
        raise NotImplementedError(f"defense {self.name!r} declares no log_likelihood")

    def privacy_spent(self, steps: int, sample_rate: float, delta: float) -> float | None:
        """Epsilon at ``delta`` after ``steps`` where the defense has a formal guarantee, else None."""
        return None
