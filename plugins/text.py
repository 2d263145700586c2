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
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


class CausalLM(nn.Module):
    """Your causal language model as a ``TokenModel``, for the monitor and the text attacks: a nanoGPT- or
    GPT-2-style model named by its parts (token and position embeddings, blocks, each block's attention
    projection and the norm before it, the final norm, the head), its own weights shared, not copied.

    The forward pass is the one every such model runs: token embedding (or the embeddings an attack optimises,
    ``(B, T, width)``) plus position embedding, the blocks in order, the final norm and the head, giving next-token
    logits ``(B, vocab, T)``; a block may return a tuple (Hugging Face's), its first item read. Dropout between
    the parts is not applied (the attacker does not know the client's masks). The attention projection must be an
    ``nn.Linear`` (nanoGPT's ``c_attn``); Hugging Face GPT-2's ``Conv1D`` keeps its weight transposed and is refused.

    Example:
        monitor.attach(CausalLM(gpt), optimizer, loader)   # train ``gpt`` as before
    """

    predicts_next_token = True
    causal = True

    def __init__(self, model: nn.Module, *, embedding: str = "transformer.wte", positions: str = "transformer.wpe",
                 blocks: str = "transformer.h", norm: str = "ln_1", attention: str = "attn.c_attn",
                 final_norm: str = "transformer.ln_f", head: str = "lm_head", pad_id: int = 0) -> None:
        super().__init__()
        self.model, self.pad_id = model, pad_id
        self._names = {"embedding": embedding, "positions": positions, "blocks": blocks, "final_norm": final_norm,
                       "head": head}
        parts = {k: _submodule(model, v, k) for k, v in self._names.items()}
        self._norm, self._attention = norm, attention
        wte, blocks_list = parts["embedding"], parts["blocks"]
        if not isinstance(wte, nn.Embedding) or not isinstance(parts["positions"], nn.Embedding):
            raise TypeError(f"CausalLM: embedding {embedding!r} and positions {positions!r} must be nn.Embedding")
        projection = _submodule(blocks_list[0], attention, "attention")
        if not isinstance(projection, nn.Linear):
            raise TypeError(f"CausalLM: attention {blocks}.0.{attention} is a {type(projection).__name__}; the "
                            "attacks read an nn.Linear's weight (outputs, width)")
        _submodule(blocks_list[0], norm, "norm")
        self.width, self.vocab_size, self.depth = wte.embedding_dim, wte.num_embeddings, len(blocks_list)

    def _part(self, key: str) -> Any:
        return self.model.get_submodule(self._names[key])

    def _embed(self, x: Tensor) -> Tensor:
        positions = self._part("positions")(torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1))
        return (self._part("embedding")(x) if x.dtype == torch.long else x) + positions

    @staticmethod
    def _through(block: nn.Module, h: Tensor) -> Tensor:
        out = block(h)
        return out[0] if isinstance(out, tuple) else out

    def forward(self, x: Tensor) -> Tensor:
        h = self._embed(x)
        for block in self._part("blocks"):
            h = self._through(block, h)
        return self._part("head")(self._part("final_norm")(h)).transpose(1, 2)

    def layer_inputs(self, ids: Tensor, layer: int) -> Tensor:
        """What block ``layer``'s attention projection reads at each position (``TokenModel``)."""
        h, blocks = self._embed(ids), self._part("blocks")
        for block in list(blocks)[:layer]:
            h = self._through(block, h)
        return blocks[layer].get_submodule(self._norm)(h)

    def attention_name(self, layer: int) -> str:
        return f"model.{self._names['blocks']}.{layer}.{self._attention}.weight"

    def embedding_name(self) -> str:
        return f"model.{self._names['embedding']}.weight"

    def position_name(self) -> str:
        return f"model.{self._names['positions']}.weight"


def _submodule(model: nn.Module, name: str, role: str) -> Any:
    """``model``'s submodule ``name``; a TypeError naming the role and the model's top-level children otherwise."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        children = ", ".join(n for n, _ in model.named_children())
        raise TypeError(f"CausalLM: {role}: the model has no submodule {name!r} (its children: {children}); name "
                        f"it with {role}=") from None


def adapter_names(weight: str) -> tuple[str, str]:
    """The names of the low-rank adapter factors ``(A, B)`` that LoRA adds to parameter ``weight`` (a module's
    ``...weight``), so that the weight in use is ``weight + B @ A`` (Hu et al. 2022): the names the ``lora``
    defense gives them (a torch parametrization) and attacks that read adapters look for."""
    module, _, tensor = weight.rpartition(".")
    prefix = f"{module}.parametrizations.{tensor}.0"
    return f"{prefix}.lora_a", f"{prefix}.lora_b"
