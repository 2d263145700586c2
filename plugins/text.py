"""Token sequences: what a text dataset holds, and what a language model shows the attacks that read its layers.

A text example is a row of token ids, padded at its end with ``pad_id``. Its label is a class (``task:
classify``: sequence classification, the setting of Deng et al. 2021, Balunovic et al. 2022 and Petrov et al. 2024)
or, for a language model trained as a keyboard's is (``task: next_token``), the row's next token at each position
(``next_token_targets``), scored by ``next_token_loss`` on logits ``(B, vocab, T)``. Attacks that
read a transformer's layers (DAGER's span filters) reach it through ``TokenModel``, so they work on any model
that names its embedding and attention weights and computes its layers' inputs, the zoo's or a user's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

#: The modalities an example can have; a dataset, model, metric or attack declares the one it applies to.
MODALITIES = ("image", "text")
#: What a text model learns from its examples: one class per sequence, or the next token at every position.
TASKS = ("classify", "next_token")
#: The target of a position that predicts nothing (padding, a sequence's last token): torch's cross-entropy skips it.
IGNORE = -100


def next_token_targets(ids: Tensor, pad_id: int) -> Tensor:
    """The next-token targets ``(B, T)`` of token rows ``(B, T)``: each position's target is the token after it,
    ``IGNORE`` where that is padding or past the row's end (a keyboard model's labels)."""
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = ids[:, 1:]
    return targets.masked_fill(targets == pad_id, IGNORE)


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The mean cross-entropy of a language model's next-token logits ``(B, vocab, T)`` over the positions that
    have a target: ``targets`` are token ids ``(B, T)`` (``IGNORE`` where none), or distributions ``(B, vocab, T)``
    whose mass weighs each position (relaxed tokens; 0 where none), which one-hot equals the ids' loss."""
    if not targets.is_floating_point():
        return F.cross_entropy(logits, targets, ignore_index=IGNORE)
    return -(targets * logits.log_softmax(1)).sum() / targets.sum().clamp_min(1e-12)


def example_shares(labels: Tensor) -> Tensor | None:
    """Each example's share of a batch's ``next_token_loss``, times the batch size ``(B,)``: its positions with a
    target (a relaxed target's mass) over the batch's mean. The batch's gradient is the mean of the examples' own
    (mean-over-their-positions) gradients weighted by it, and Opacus's per-sample gradients of a mean loss carry
    it. None for class labels, where every share is 1."""
    if labels.dim() == 3 and labels.is_floating_point():
        mass = labels.sum((1, 2))
    elif labels.dim() == 2 and not labels.is_floating_point():
        mass = (labels != IGNORE).sum(1).to(torch.get_default_dtype())
    else:
        return None
    return mass * len(mass) / mass.sum().clamp_min(1e-12)


def predicts_next_token(model: object) -> bool:
    """Whether a language model is trained on next-token prediction (``task: next_token``; its logits
    ``(B, vocab, T)``): its ``predicts_next_token`` attribute, False where it has none (a classifier)."""
    return bool(getattr(model, "predicts_next_token", False))


@dataclass
class TokenData:
    """Train and test splits of token sequences ``(N, length)`` with their labels (classes ``(N,)``, or under
    ``task: next_token`` the next tokens ``(N, length)``), the vocabulary that decodes them, and, per example, the
    personal values its sentence holds (``pii``: what PII recall counts)."""

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
    task: str = "classify"

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
