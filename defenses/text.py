"""Defenses of language models' updates that change what the client trains.

``frozen_embeddings`` (Gupta et al. 2022, FILM): the client does not train the token embedding (and, if asked,
the position embedding), so the update has no gradient of it. That gradient's non-zero rows are exactly the
batch's tokens where the embedding is untied, so freezing it takes away the token set; the transformer's
later layers still share their gradients, and DAGER (Petrov et al. 2024) reads the sequences from the first
attention layers' span wherever its rank condition holds.

``lora`` (Hu et al. 2022): the client trains low-rank adapters ``B @ A`` beside frozen weights and shares only
their gradients and the classifier head's, as parameter-efficient fine-tuning of a classifier does. The gradient
of ``B`` is the weight's gradient projected on the ``rank`` rows of ``A``: DAGER's span check then works in
``rank`` dimensions, so it reads the batch only while its tokens are fewer than the rank (Petrov et al. 2024).
"""
from __future__ import annotations

from typing import ClassVar

import math

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import ADAPTERS, NO_EMBEDDING, DeterministicDefense
from leakaudit.plugins.text import TokenModel


class FrozenEmbeddings(DeterministicDefense):
    """The token embedding (and the position embedding with ``positions: true``) left out of training: what is
    shared is every other gradient, exactly."""

    name = "frozen_embeddings"
    paper = "Gupta et al. 2022"
    shares = NO_EMBEDDING
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


class LowRankAdapter(nn.Module):
    """A weight's low-rank update as a torch parametrization: ``weight + scale * B @ A``, ``A`` drawn as LoRA
    draws it (Kaiming-uniform), ``B`` zero, so that the model starts as it was. Its factors' names are
    ``adapter_names(weight)`` (leakaudit.plugins.text)."""

    def __init__(self, weight: Tensor, rank: int, alpha: float):
        super().__init__()
        outputs, inputs = weight.shape
        self.lora_a = nn.Parameter(torch.empty(rank, inputs, device=weight.device, dtype=weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(outputs, rank, device=weight.device, dtype=weight.dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, weight: Tensor) -> Tensor:
        return weight + self.scale * self.lora_b @ self.lora_a


def draw_adapters(model: nn.Module, std: float = 0.02) -> nn.Module:
    """``model`` with its LoRA adapters' B drawn away from zero (normal, ``std``, from torch's global generator), as
    after training rounds: LoRA starts B at zero, where dL/dA vanishes, and later rounds' updates carry both."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, std)
    return model


class Lora(DeterministicDefense):
    """LoRA-only updates (Hu et al. 2022): every weight but the attention projections' adapters and the
    classifier head frozen, so the client shares the adapters' gradients and the head's, exactly. The head is
    the model's last ``nn.Linear``, trained as PEFT's ``modules_to_save`` trains a classifier's: the update's
    labels are read from it."""

    name = "lora"
    paper = "Hu et al. 2022"
    shares = ADAPTERS
    modalities = ("text",)
    params: ClassVar[dict[str, Param]] = {
        "rank": Param(8, int, min=1, help="the adapters' rank r: A is r x width, B outputs x r"),
        "alpha": Param(16.0, float, min=0.0, exclusive_min=True,
                       help="the adapters' scale numerator: B @ A is multiplied by alpha / rank"),
    }
    rank: int
    alpha: float

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if not isinstance(model, TokenModel):
            raise ValueError("lora adapts a language model's attention: the model is not a TokenModel "
                             "(leakaudit.plugins.text)")
        targets = [model.attention_name(layer) for layer in range(model.depth)]
        last = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]  # the classifier head
        for name, p in model.named_parameters():
            p.requires_grad_(name.rpartition(".")[0] == last)
        for name in targets:
            module, _, tensor = name.rpartition(".")
            layer = model.get_submodule(module)
            parametrize.register_parametrization(layer, tensor, LowRankAdapter(getattr(layer, tensor), self.rank,
                                                                                self.alpha))
        self.model_changes = [f"{len(targets)} attention projections ({', '.join(targets)}) take rank-{self.rank} "
                              f"adapters; every other weight frozen but the head ({last})"]
        return model


@hookimpl
def register_defenses():
    return [FrozenEmbeddings, Lora]
