"""Token sequences: what a text dataset holds, and what a language model shows the attacks that read its layers.

A text example is a row of token ids, padded at its end with ``pad_id``; its label is a class (sequence
classification, the setting of Deng et al. 2021, Balunovic et al. 2022 and Petrov et al. 2024). Attacks that
read a transformer's layers (DAGER's span filters) reach it through ``TokenModel``, so they work on any model
that names its embedding and attention weights and computes its layers' inputs, the zoo's or a user's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

from torch import Tensor

#: The modalities an example can have; a dataset, model, metric or attack declares the one it applies to.
MODALITIES = ("image", "text")


@dataclass
class TokenData:
    """Train and test splits of token sequences ``(N, length)`` with class labels, the vocabulary that decodes
    them, and, per example, the personal values its sentence holds (``pii``: what PII recall counts)."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int
    vocabulary: list[str]
    pad_id: int = 0
    train_pii: list[list[str]] = field(default_factory=list)
    test_pii: list[list[str]] = field(default_factory=list)

    modality = "text"

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    @property
    def length(self) -> int:
        """Tokens per sequence, padding included."""
        return self.train_x.shape[1]

    def decode(self, ids: Tensor) -> str:
        """One sequence's text: its tokens joined by spaces, the padding left out."""
        return decode_tokens(ids, self.vocabulary, self.pad_id)


def decode_tokens(ids: Tensor, vocabulary: Sequence[str] | None, pad_id: int) -> str:
    """A sequence of token ids as text: each id's token joined by spaces, the padding left out; an id the
    vocabulary lacks (or every id, without one) reads as its number."""
    words = vocabulary or ()
    return " ".join(words[int(i)] if int(i) < len(words) else str(int(i)) for i in ids if int(i) != pad_id)


@runtime_checkable
class TokenModel(Protocol):
    """A transformer over token ids whose first layers an attack can read.

    ``layer_inputs(ids, layer)`` is what layer ``layer``'s attention projections read for each position, shape
    ``(B, T, width)``: after the embeddings (and the layers before it) and the layer's own normalisation. The
    gradient of ``attention_name(layer)``'s weight, ``(outputs, width)`` as ``nn.Linear`` keeps it, is a sum of
    outer products of those inputs, so its row space holds them (Petrov et al. 2024). ``embedding_name()`` and
    ``position_name()`` name the token and the learned position embeddings."""

    width: int
    vocab_size: int
    depth: int
    causal: bool
    pad_id: int

    def layer_inputs(self, ids: Tensor, layer: int) -> Tensor: ...

    def attention_name(self, layer: int) -> str: ...

    def embedding_name(self) -> str: ...

    def position_name(self) -> str: ...


def adapter_names(weight: str) -> tuple[str, str]:
    """The names of the low-rank adapter factors ``(A, B)`` that LoRA adds to parameter ``weight`` (a module's
    ``...weight``), so that the weight in use is ``weight + B @ A`` (Hu et al. 2022): the names the ``lora``
    defense gives them (a torch parametrization) and attacks that read adapters look for."""
    module, _, tensor = weight.rpartition(".")
    prefix = f"{module}.parametrizations.{tensor}.0"
    return f"{prefix}.lora_a", f"{prefix}.lora_b"
