"""Defenses of language models' updates that change what the client trains.

``frozen_embeddings`` (Gupta et al. 2022, FILM): the client does not train the token embedding (and, if asked,
the position embedding), so the update has no gradient of it. That gradient's non-zero rows are exactly the
batch's tokens where the embedding is untied, so freezing it takes away the token set; the transformer's
later layers still share their gradients, and DAGER (Petrov et al. 2024) reads the sequences from the first
attention layers' span wherever its rank condition holds.
"""
from __future__ import annotations

from typing import ClassVar

from torch import nn

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import DeterministicDefense
from leakaudit.plugins.text import TokenModel


class FrozenEmbeddings(DeterministicDefense):
    """The token embedding (and the position embedding with ``positions: true``) left out of training: what is
    shared is every other gradient, exactly."""

    name = "frozen_embeddings"
    paper = "Gupta et al. 2022"
    modalities = ("text",)
    params: ClassVar[dict[str, Param]] = {
        "positions": Param(False, bool, help="freeze the position embedding too (its gradient's rows tell the "
                                             "sequences' length)"),
    }
    positions: bool

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if not isinstance(model, TokenModel):
            raise ValueError("frozen_embeddings freezes a language model's embeddings: the model is not a TokenModel "
                             "(leakaudit.plugins.text)")
        names = [model.embedding_name()] + ([model.position_name()] if self.positions else [])
        params = dict(model.named_parameters())
        for name in names:
            params[name].requires_grad_(False)
        self.model_changes = [f"{name} frozen: not trained, its gradient not shared" for name in names]
        return model


@hookimpl
def register_defenses():
    return [FrozenEmbeddings]
