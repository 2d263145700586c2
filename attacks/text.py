"""Attacks on the updates of language models: the tokens from the embedding's gradient (Melis et al. 2019), DAGER's
exact recovery of whole sequences from the span of the first attention layers' gradients (Petrov et al. 2024),
TAG's optimisation of continuous embeddings (Deng et al. 2021), LAMP's alternation of that optimisation with
reorderings ranked by a language model (Balunovic et al. 2022), and the Bayes adversary on the defense's own
likelihood through relaxed tokens (Balunovic et al. 2022's adversary, with tokens relaxed to distributions)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import reduce
from typing import Any, Callable, ClassVar, cast

import torch
from torch import Tensor, nn

from leakaudit.attacks.labels import last_layer_gradients, output_layer, recover_labels
from leakaudit.plugins import hookimpl
from leakaudit.plugins.attack import Attack, Reconstruction, ThreatModel, EAVESDROPPER, HONEST_SERVER
from leakaudit.plugins.defense import ADAPTERS, FULL, NO_EMBEDDING, Defense, SharedUpdate
from leakaudit.plugins.protocol import Protocol, not_one_step, parameter_names
from leakaudit.plugins.spec import Param
from leakaudit.plugins.text import IGNORE, TokenModel, adapter_names, next_token_targets, predicts_next_token

#: Sequences whose second-layer inputs are computed at once while growing prefixes (bounds the memory).
CHUNK = 4096
#: The largest vocabulary whose bigram prior the Bayes adversary keeps as a dense table (64 MiB of float32).
DENSE_PRIOR = 4096
#: The least drop between consecutive singular values that separates a gradient's span from its rounding.
GAP = 10.0
#: Rows of the room left in the span below the width: a gradient of rank within this of the width spans
#: (nearly) every vector, and its filters pass anything (DAGER caps its rank at the width less 20 for GPT-2's 768).
RANK_MARGIN = 4


def not_a_token_model(model: torch.nn.Module, reads: str) -> str | None:
    """Why an attack that ``reads`` a language model's parts cannot read ``model``; None where it is a TokenModel."""
    if isinstance(model, TokenModel):
        return None
    return f"{reads}: the model is not a TokenModel (leakaudit.plugins.text)"


# The budgets of the text attacks that optimise (TAG, LAMP, the Bayes adversary) under ``attacks: auto``: 300
# steps read a 14-token sentence back on a 2-layer model on a CPU (tests/test_text.py); a GPU affords TAG's paper's.
def optimiser_budgets() -> dict[str, dict[str, Any]]:
    """A fresh copy of those budgets for one class (a class's ``auto_params`` is its own)."""
    return {"cpu": {"iterations": 300}, "cuda": {"iterations": 2500}}

#: LAMP's discrete steps, as LAMP and the Bayes adversary on text take them.
DISCRETE_STEPS: dict[str, Param] = {
    "every": Param(25, int, min=1, help="continuous steps between two discrete steps (in the second half)"),
    "candidates": Param(100, int, min=1, help="reorderings tried in each discrete step"),
}


def text_labels(observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Tensor:
    """The batch's labels, from the classifier head's gradients where the threat does not grant them: its signs
    for one sentence (iDLG), a feature fit of the class counts for a batch where the head has a bias, the signs
    otherwise (Geng et al.'s dummy inputs are images, which a language model does not read)."""
    batch = threat.batch_size > 1 and last_layer_gradients(observed)[1] is not None
    return recover_labels(observed, threat, "feature_fit" if batch else "signs", generator)


def labels_of(rows: Tensor, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Tensor:
    """The labels beside recovered ``rows``: a next-token model's are the rows' own next tokens; a classifier's are
    read from its head (``text_labels``)."""
    if predicts_next_token(threat.model):
        return next_token_targets(rows, cast(Any, threat.model).pad_id)
    return text_labels(observed, threat, generator)


def relaxed_targets(p: Tensor, pad_id: int) -> Tensor:
    """A next-token model's targets of relaxed sentences ``p`` ``(B, L, vocab)``, as ``next_token_loss`` takes them
    ``(B, vocab, L)``: position t's target is position t + 1's distribution less its padding mass (padding
    predicts nothing), and the last position's is none."""
    following = torch.cat([p[:, 1:], torch.zeros_like(p[:, :1])], 1)
    keep = torch.ones(p.shape[-1], dtype=p.dtype, device=p.device)
    keep[pad_id] = 0
    return (following * keep).transpose(1, 2)


def following_tokens(observed: SharedUpdate, threat: ThreatModel, rows: Tensor) -> Tensor | None:
    """A next-token model's token after each row's last ``(B,)``, read from the output layer's weight gradient.
    A row's last token is a target only (the position that reads it predicts padding), so the layers before the
    head never see it. The head's gradient is ``(P - Y)^T H / N`` over the N positions with a target; with the
    rows as inputs, all of it is known but each row's last target, and what is left, ``sum_b e_(u_b) h_b^T``, is
    solved for each row's share on the rows' last states ``h_b`` (least squares). Exact under FedSGD where the
    rows are right and their last states independent; None where the update does not share the head's own
    weight (frozen, or tied to the token embedding, whose gradient then mixes in the inputs'). A row that fills
    the input has no token after it (its own, ``pad_id``)."""
    model: Any = threat.model
    head = output_layer(model)
    name = {id(p): n for n, p in model.named_parameters()}.get(id(head.weight))
    tied = head.weight is dict(model.named_parameters()).get(model.embedding_name())
    if name is None or name not in observed.names or tied or not len(rows):
        return None
    states: list[Tensor] = []
    hook = head.register_forward_hook(lambda module, inputs, output: states.append(inputs[0]))
    try:
        with torch.no_grad():
            logits = model(rows)
    finally:
        hook.remove()
    h, length = states[0].double(), rows.shape[1]  # (B, T, width)
    counts = (rows != model.pad_id).sum(1)
    reach = counts.clamp_max(length - 1)  # the positions with a target; a full row's last has none
    real = (torch.arange(length, device=rows.device)[None] < reach[:, None]).double()
    known = next_token_targets(rows, model.pad_id)
    targets = torch.zeros(*known.shape, model.vocab_size, dtype=torch.float64, device=rows.device).scatter_(
        2, known.clamp_min(0)[..., None], (known >= 0).double()[..., None])
    error = (logits.double().softmax(1).transpose(1, 2) - targets) * real[..., None]
    scale = threat.protocol.gradient_scale(threat.batch_size)
    left = (torch.einsum("btv,btd->vd", error, h)
            - reach.sum() * scale * gradient_of(observed, name).to(h.device, torch.float64))
    open_rows = torch.nonzero((counts > 0) & (counts < length)).flatten()
    after = torch.full_like(counts, model.pad_id)
    if len(open_rows):
        last = h[open_rows, counts[open_rows] - 1]  # (rows, width)
        share = torch.linalg.pinv(last.T) @ left.T  # each open row's share of every word, (rows, vocab)
        share[:, model.pad_id] = -math.inf
        after[open_rows] = share.argmax(1)
    return after


def completed(observed: SharedUpdate, threat: ThreatModel, rows: Tensor) -> Tensor:
    """A next-token model's rows with the token after each row's last (``following_tokens``) put in place, where
    the row has room and the update shares the head; other models' rows as they are."""
    if not predicts_next_token(threat.model):
        return rows
    after = following_tokens(observed, threat, rows)
    if after is None:
        return rows
    pad = cast(Any, threat.model).pad_id
    rows = rows.clone()
    room = torch.nonzero(after != pad).flatten()  # following_tokens gives padding to a row without room
    rows[room, (rows[room] != pad).sum(1)] = after[room]
    return rows


def gradient_of(observed: SharedUpdate, name: str) -> Tensor:
    """The shared tensor of parameter ``name``; a clear error where the update lacks it."""
    if name not in observed.names:
        raise ValueError(f"the update has no gradient of {name!r} (it shares {len(observed.names)} tensors)")
    return observed.tensors[observed.names.index(name)]


def token_set(observed: SharedUpdate, model: TokenModel, tolerance: float = 0.0, most: int | None = None) -> Tensor:
    """The ids whose embedding row has a gradient, largest row first: exactly the batch's tokens where the embedding
    is its own (untied) and the update is exact (Melis et al. 2019). Rows are compared with ``tolerance`` times the
    largest row's norm; ``most`` keeps the largest rows (under noise every row has a gradient). No ids where the
    update does not share the embedding's gradient (frozen embeddings)."""
    if model.embedding_name() not in observed.names:
        return torch.empty(0, dtype=torch.long)
    norms = gradient_of(observed, model.embedding_name()).double().norm(dim=1)
    rows = torch.nonzero(norms > tolerance * norms.max()).flatten()
    return rows[norms[rows].argsort(descending=True)][:most]


def sequence_length(observed: SharedUpdate, model: TokenModel, longest: int) -> int:
    """The positions that reach the loss: the rows of the position embedding's gradient that are not zero (a
    causal model's positions past the last token it reads get none); ``longest`` where the update lacks it."""
    if model.position_name() not in observed.names:
        return longest
    rows = torch.nonzero(gradient_of(observed, model.position_name()).norm(dim=1)).flatten()
    return int(rows.max()) + 1 if len(rows) else longest


def span_basis(gradient: Tensor, floor: float) -> Tensor:
    """An orthonormal basis ``(rank, width)`` of the row space of a weight's gradient ``(outputs, width)``: its
    right singular vectors down to the spectrum's last drop by ten or more from one singular value to the next
    (among those above ``floor`` times the largest); where there is none, those above the floor. The last drop,
    not the largest: an update rebuilt from float32 weights (``(before - after) / lr``) has a rounding floor
    near 1e-6 of the largest, and the signal's own spectrum may fall further at its top than onto that floor."""
    _, s, vh = torch.linalg.svd(gradient.double(), full_matrices=False)
    above = int((s > floor * s[0]).sum())
    upper = s[:min(above, len(s) - 1)]
    big = torch.nonzero(upper / s[1:len(upper) + 1].clamp_min(1e-300) >= GAP).flatten()
    rank = above if len(big) == 0 else int(big.max()) + 1
    return vh[:rank]


def span_distance(vectors: Tensor, basis: Tensor) -> Tensor:
    """How far each vector ``(..., width)``, scaled to unit length, lies from the span: its residual's norm."""
    v = vectors.double()
    v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return (v - (v @ basis.T) @ basis).norm(dim=-1)


@dataclass
class Span:
    """Where a layer's inputs lie, as the update shows it: one or more tests, each an orthonormal basis
    ``(rank, dim)`` of a gradient's row space, the map that takes an input into that space (None: the input
    itself) and the most rank the test can show (its ``dim``, or an adapter's rank where fewer). An input passes
    where it lies in every test's span. ``adapter_rank``: the adapters' rank where the spans are theirs."""

    tests: list[tuple[Tensor, Tensor | None, int]]
    adapter_rank: int | None = None

    @property
    def rank(self) -> int:
        return max(len(basis) for basis, _, _ in self.tests)

    @property
    def dim(self) -> int:
        return min(most for _, _, most in self.tests)

    def fits(self) -> bool:
        """Whether every test's span stays ``RANK_MARGIN`` under the most it can show: a span that fills it
        holds any input (or, of ``dL/dA``, only part of the inputs' span), and tells nothing."""
        return all(len(basis) <= most - RANK_MARGIN for basis, _, most in self.tests)

    def to(self, device: torch.device) -> Span:
        return Span([(b.to(device), None if m is None else m.to(device), most) for b, m, most in self.tests],
                    self.adapter_rank)

    def distance(self, inputs: Tensor) -> Tensor:
        """How far each input ``(..., width)`` lies from the spans: the largest ``span_distance`` of its tests."""
        return torch.stack([span_distance(inputs if m is None else inputs.double() @ m.T, basis)
                            for basis, m, _ in self.tests]).amax(0)


def padded_rows(tokens: Tensor, length: int, pad_id: int) -> Tensor:
    """Tokens ``(B, n)`` at the start of rows of ``length`` ids, the rest ``pad_id``, on the tokens' device."""
    rows = torch.full((len(tokens), length), pad_id, dtype=torch.long, device=tokens.device)
    rows[:, : tokens.shape[1]] = tokens
    return rows


def token_rows(tokens: Tensor, model: Any, batch: int, length: int, device: torch.device) -> Tensor:
    """The tokens, unordered, in every row of the batch (padding left out; the rest padded): what the embedding's
    gradient gives without an order."""
    tokens = tokens[tokens != model.pad_id][:length].to(device)
    return padded_rows(tokens.expand(batch, -1), length, model.pad_id)


class TokenSet(Attack):
    """The batch's words from the token embedding's gradient (Melis et al. 2019): its rows are zero but for the
    tokens the batch holds, where the embedding is untied. Every row gets the set, largest gradient first, with no
    order; under noise, the rows of largest norm, as many as the batch's positions. Frozen embeddings (FILM) share
    no such gradient: it then reads nothing."""
    attacker = EAVESDROPPER

    name = "token_set"
    paper = "Melis et al. 2019"
    modality = "text"
    params: ClassVar[dict[str, Param]] = {
        "tolerance": Param(0.0, float, min=0.0, help="rows whose norm is at most this share of the largest count "
                           "as zero"),
    }
    brings: ClassVar[str] = "the batch's words from the embedding's gradient"
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {}}  # a row norm per token: no budget to set

    tolerance: float

    def unsupported(self, model: torch.nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        return not_a_token_model(model, "token_set reads a language model's embedding")

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        model: Any = threat.model
        length, batch = threat.input_shape[0], observed.batch_size
        rows = token_rows(token_set(observed, model, self.tolerance), model, batch, length, threat.device)
        extras: dict[str, Any] = {"tokens": int((rows[0] != model.pad_id).sum())}  # what one row holds
        if model.embedding_name() not in observed.names:
            extras["note"] = "the update shares no gradient of the token embedding (frozen): no tokens to read"
        return Reconstruction(rows, labels_of(rows, observed, threat, generator), [], 0.0, extras)


class Dager(Attack):
    """DAGER (Petrov et al. 2024): the tokens whose first-layer input lies in the span of the first attention
    weight's gradient, at each position; then whole sequences checked against the second layer's span. For a
    causal model they are grown token by token, keeping each prefix whose last second-layer input lies in the
    span (greedy). For an encoder, where every position's second-layer input depends on the whole sequence,
    every sentence of each length made of the positions' candidates is checked (exhaustive), while they are at
    most ``max_combinations``; past that it says so and returns the token set. Exact while the batch's tokens
    are fewer than the width; where they are not, it says "rank condition not met" and returns the token set
    instead. Under LoRA it reads the adapters' gradients, in which the same condition holds
    against their rank; since it runs there whatever the rank, its LoRA reads do not calibrate a "protects"
    (``reads``); ``adapter_span``'s do, as it refuses where the rank cannot hold the batch."""
    attacker = HONEST_SERVER
    reads: ClassVar[tuple[str, ...]] = (FULL, NO_EMBEDDING)

    name = "dager"
    paper = "Petrov et al. 2024"
    modality = "text"
    params: ClassVar[dict[str, Param]] = {
        "first_tolerance": Param(1e-3, float, min=0.0, help="span distance below which a token passes at a "
                                 "position (first layer; vectors of unit length)"),
        "second_tolerance": Param(1e-3, float, min=0.0, help="span distance below which a prefix's last "
                                  "position passes (second layer)"),
        "rank_floor": Param(1e-7, float, min=0.0, help="singular values below this share of the largest are "
                            "rounding (a float32 update's), whatever the spectrum's gaps"),
        "max_prefixes": Param(2_000, int, min=1, help="prefixes kept per step (the closest first; causal models)"),
        "max_combinations": Param(100_000, int, min=1, help="the most sentences of one length the encoders' "
                                  "exhaustive search checks (past it: the token set)"),
    }
    brings: ClassVar[str] = "exact sequences from the span of attention gradients"
    noise_free_only: ClassVar[bool] = True
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {}}  # linear algebra: no budget to set

    first_tolerance: float
    second_tolerance: float
    rank_floor: float
    max_prefixes: int
    max_combinations: int

    def unsupported(self, model: torch.nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if not isinstance(model, TokenModel):
            return not_a_token_model(model, f"{self.name} reads a transformer's layers")
        if model.depth < 3:
            # the last layer's gradient reaches each sequence through its one read position: its span is
            # too narrow to hold every position's input
            return f"{self.name} needs at least 3 transformer blocks; this model has {model.depth}"
        return not_one_step(protocol, batch_size, self.name)

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        model: Any = threat.model
        length, batch = threat.input_shape[0], observed.batch_size
        extras: dict[str, Any] = {"width": model.width}
        with torch.no_grad():
            rows = self._read(observed, model, batch, length, threat.device, extras)
            if rows is None:  # no span, or one that holds any sequence (the note says which)
                rows = token_rows(token_set(observed, model), model, batch, length, threat.device)
            else:  # a next-token model's last tokens reach only its head
                rows = completed(observed, threat, rows)
        return Reconstruction(rows, labels_of(rows, observed, threat, generator), [], 0.0, extras)

    def _read(self, observed: SharedUpdate, model: Any, batch: int, length: int, device: torch.device,
              extras: dict[str, Any]) -> Tensor | None:
        """The batch's sequences from the first two layers' spans; None, with a note in ``extras``, where the update
        shares no span or the rank condition fails."""
        first, second = self._span(observed, model, 0), self._span(observed, model, 1)
        if first is None or second is None:
            extras["note"] = ("the update shares neither the first attention weights' gradients nor their "
                              "adapters' (frozen): no span to read; the token set is returned")
            return None
        extras["rank"] = [first.rank, second.rank]
        if first.adapter_rank is not None:
            extras["adapter_rank"] = first.adapter_rank
        if not (first.fits() and second.fits()):
            where = "width" if first.adapter_rank is None else "adapters' rank"
            extras["note"] = (f"rank condition not met: the attention gradients have rank {first.rank} and "
                              f"{second.rank} of {where} {first.dim} (the batch's tokens are not fewer than the "
                              f"{where}), so their span holds any sequence; the token set is returned")
            return None
        candidates = self._candidates(model, first.to(device), length, device)
        if model.causal:
            return self._grow(model, second.to(device), candidates, batch, length, device)
        return self._search(model, second.to(device), candidates, batch, length, device, extras)

    def _span(self, observed: SharedUpdate, model: Any, layer: int) -> Span | None:
        """The span that layer ``layer``'s inputs lie in: the row space of the attention weight's gradient, or,
        under LoRA, of its adapter ``B``'s gradient, in which the inputs appear through ``A`` (it is ``scale * G
        A^T`` for the weight's gradient ``G``, whatever ``B`` is). None where the update shares neither."""
        name = model.attention_name(layer)
        if name in observed.names:
            return Span([(span_basis(gradient_of(observed, name), self.rank_floor), None, model.width)])
        a_name, b_name = adapter_names(name)
        if b_name in observed.names:
            a = dict(model.named_parameters())[a_name].detach().double()
            return Span([(span_basis(gradient_of(observed, b_name), self.rank_floor), a, len(a))], len(a))
        return None

    def _candidates(self, model: Any, span: Span, length: int, device: torch.device) -> list[Tensor]:
        """Per position, the ids whose first-layer input there lies in the span (closest first)."""
        ids = torch.arange(model.vocab_size, device=device)[:, None].expand(model.vocab_size, length)
        distance = span.distance(model.layer_inputs(ids, 0))  # (vocab, length)
        out = []
        for p in range(length):
            passing = torch.nonzero(distance[:, p] < self.first_tolerance).flatten()
            out.append(passing[distance[passing, p].argsort()])
        return out

    def _grow(self, model: Any, span: Span, candidates: list[Tensor], batch: int, length: int,
              device: torch.device) -> Tensor:
        """Sequences grown position by position: a prefix extended by each candidate whose second-layer input
        lies in the span; a prefix that no candidate extends is a finished sequence."""
        prefixes, finished = candidates[0][:, None], list[Tensor]()
        for p in range(1, length):
            if len(prefixes) == 0 or len(candidates[p]) == 0:
                break
            grown = torch.cat([prefixes.repeat_interleave(len(candidates[p]), 0),
                               candidates[p].repeat(len(prefixes))[:, None]], dim=1)
            distance = torch.cat([span.distance(model.layer_inputs(part, 1)[:, -1]) for part in grown.split(CHUNK)])
            keep = distance < self.second_tolerance
            extended = torch.zeros(len(prefixes), dtype=torch.bool, device=device)
            extended[torch.div(torch.nonzero(keep).flatten(), len(candidates[p]), rounding_mode="floor")] = True
            finished.extend(prefixes[~extended])
            order = distance[keep].argsort()[: self.max_prefixes]
            prefixes = grown[keep][order]
        finished.extend(prefixes)
        rows = torch.full((batch, length), model.pad_id, dtype=torch.long, device=device)
        for i, seq in enumerate(sorted(finished, key=len, reverse=True)[:batch]):
            rows[i, : len(seq)] = seq
        return rows

    def _search(self, model: Any, span: Span, candidates: list[Tensor], batch: int, length: int,
                device: torch.device, extras: dict[str, Any]) -> Tensor | None:
        """Encoders: at each length, every sentence made of the positions' candidates, kept where its second-layer
        input at every position lies in the span; the ``batch`` closest (by their farthest position). A sentence
        the batch holds twice comes back once. None, with a note, where a length has more than
        ``max_combinations`` such sentences (no exhaustive search)."""
        found, scores = [], []
        for size in range(1, length + 1):
            lists = candidates[:size]
            total = math.prod(len(c) for c in lists)
            if total == 0:
                break
            if total > self.max_combinations:
                extras["note"] = (f"the encoder search has {total:.3g} sentences of length {size} to check, more than "
                                  f"max_combinations {self.max_combinations:,} (the first filter passes "
                                  f"{max(len(c) for c in lists)} tokens at a position): the token set is returned")
                return None
            picks = torch.cartesian_prod(*[torch.arange(len(c), device=device) for c in lists]).view(total, size)
            sentences = torch.full((total, length), model.pad_id, dtype=torch.long, device=device)
            sentences[:, :size] = torch.stack([c[picks[:, p]] for p, c in enumerate(lists)], 1)
            distance = torch.cat([span.distance(model.layer_inputs(part, 1)[:, :size]).amax(1)
                                  for part in sentences.split(CHUNK)])
            keep = distance < self.second_tolerance
            found.append(sentences[keep])
            scores.append(distance[keep])
        rows = torch.full((batch, length), model.pad_id, dtype=torch.long, device=device)
        if found:
            order = torch.cat(scores).argsort()[:batch]
            rows[: len(order)] = torch.cat(found)[order]
        return rows


class AdapterSpan(Dager):
    """The span test on the adapters' input (Petrov et al. 2024's span check, as Chen et al. 2026 read adapter
    updates): for an adapted projection ``y = W x + s B A x`` the update holds ``dL/dA = s B^T G`` and ``dL/dB = s
    G A^T``, where ``G = delta X^T`` is the frozen weight's gradient, whose rows span the layer's inputs ``X``. So
    ``dL/dA``'s rows lie in that span, in the full width (zero while ``B`` is, at the adapters' start), and
    ``dL/dB``'s rows in the span of ``A X``, in the rank's dimensions; a token passes where its input lies in
    both. Each holds at most ``rank`` directions: the whole span only while the batch's tokens are fewer than the
    rank, and it refuses where a batch of its sequences may hold more (sequences times the position embedding's
    rows, so a model whose positions outnumber its inputs' length is refused early). On an update of the full weights it is
    DAGER. The head's gradient gives the labels, as DAGER's does."""
    attacker = HONEST_SERVER

    name = "adapter_span"
    paper = "Petrov et al. 2024; Chen et al. 2026"
    reads: ClassVar[tuple[str, ...]] = (FULL, NO_EMBEDDING, ADAPTERS)
    brings: ClassVar[str] = "exact sequences from the span of the adapters' gradients (LoRA)"

    def unsupported(self, model: torch.nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        why = super().unsupported(model, batch_size, protocol)
        if why:
            return why
        named = dict(model.named_parameters())
        tokenised: Any = model
        a = named.get(adapter_names(tokenised.attention_name(0))[0])
        if tokenised.position_name() not in named:
            return (f"adapter_span bounds an update's tokens by the position embedding's rows: the model has no "
                    f"parameter {tokenised.position_name()!r}")
        positions = batch_size * len(named[tokenised.position_name()])
        room = (tokenised.width if a is None else len(a)) - RANK_MARGIN
        if positions <= room:
            return None
        where = f"the width {tokenised.width}" if a is None else f"the adapters' rank {len(a)}"
        return (f"adapter_span: a span of {where} holds at most {room} tokens, and an update of {batch_size} "
                f"sequences of up to {positions // batch_size} positions may hold {positions}: the rank condition "
                "cannot be met (Petrov et al. 2024)")

    def _span(self, observed: SharedUpdate, model: Any, layer: int) -> Span | None:
        """DAGER's span, and under LoRA beside ``dL/dB``'s (through ``A``) the row space of ``dL/dA`` in the full
        width, where it is not zero (``B`` is not, past the adapters' start)."""
        span = super()._span(observed, model, layer)
        a_name = adapter_names(model.attention_name(layer))[0]
        if span is None or span.adapter_rank is None or a_name not in observed.names:
            return span
        gradient = gradient_of(observed, a_name)
        if not gradient.abs().max() > 0:
            return span
        return Span(span.tests + [(span_basis(gradient, self.rank_floor), None, len(gradient))], span.adapter_rank)


class Matching:
    """What TAG and LAMP optimise: continuous input embeddings whose update matches the observed one in squared
    distance plus ``l1_weight`` times the absolute distance, the embedding's own gradient left out (the candidate
    feeds embeddings, not ids). The update is FedSGD's gradient, or the protocol's unrolled local steps (FedAvg).
    There the candidate's embeddings stay as they are: exact for one local step; from the second on, the client
    reads embedding rows its earlier steps moved, so every later tensor differs from the candidate's by that move
    (of the local learning rate's order). A next-token model's targets are the candidate's own next tokens (each
    position's nearest, the last read from the head: ``following_tokens``), taken afresh at every step."""

    def __init__(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator, l1_weight: float):
        model: Any = threat.model
        self.model, self.threat, self.l1_weight, self.batch = model, threat, l1_weight, observed.batch_size
        self.observed = observed
        self.embedding = dict(model.named_parameters())[model.embedding_name()].detach()
        named = [(n, p) for n, p in model.named_parameters() if n in observed.names and n != model.embedding_name()]
        self.params = [p for _, p in named]
        self.shared = [parameter_names(model).index(n) for n, _ in named]  # their places in the protocol's update
        self.targets = [gradient_of(observed, n).to(threat.device) for n, _ in named]
        self.labels = None if predicts_next_token(model) else text_labels(observed, threat, generator)
        self.scale = self.embedding.norm(dim=1).mean()  # a token embedding's typical length
        self.length = sequence_length(observed, model, threat.input_shape[0])
        self.allowed = torch.arange(model.vocab_size, device=threat.device)
        if model.embedding_name() in observed.names:  # read tokens only from the set the update reveals
            self.allowed = token_set(observed, model).to(threat.device)

    def start(self, count: int, generator: torch.Generator) -> Tensor:
        """``count`` random batches of embeddings ``(count, B, length, width)``, each vector of a token's length."""
        x = torch.randn((count, self.batch, self.length, self.model.width), generator=generator,
                        device=generator.device).to(self.threat.device)
        return x * self.scale / x.norm(dim=-1, keepdim=True)

    def labels_for(self, x: Tensor) -> Tensor:
        """The labels embeddings ``x`` are matched with: the classes read from the head, or a next-token model's
        next tokens of the sentence ``x`` reads, the token after its last from the head (``IGNORE`` without one)."""
        if self.labels is not None:
            return self.labels
        with torch.no_grad():
            tokens = self.tokens(x)
            after = following_tokens(self.observed, self.threat, self.rows(tokens))
        last = torch.full_like(tokens[:, :1], IGNORE) if after is None else after.masked_fill(
            after == self.model.pad_id, IGNORE)[:, None]
        return torch.cat([tokens[:, 1:], last], 1)

    def update(self, x: Tensor, create_graph: bool = True) -> list[Tensor]:
        """The matched tensors of the update that embeddings ``x`` ``(B, length, width)`` would produce."""
        protocol, labels = self.threat.protocol, self.labels_for(x)
        if protocol.sends_gradient:
            return list(torch.autograd.grad(self.threat.loss_fn(self.model(x), labels), self.params,
                                            create_graph=create_graph))
        update = protocol.attacker_update(self.model, self.threat.loss_fn, x, labels, create_graph)
        return [update[i] for i in self.shared]

    def distance(self, x: Tensor, create_graph: bool = True) -> Tensor:
        """The matching loss of embeddings ``x`` ``(B, length, width)``."""
        grads = self.update(x, create_graph)
        return torch.stack([((g - t) ** 2).sum() + self.l1_weight * (g - t).abs().sum()
                            for g, t in zip(grads, self.targets)]).sum()

    def tokens(self, x: Tensor, restrict: bool = True) -> Tensor:
        """Each position's nearest token by cosine, among the revealed set where ``restrict`` (never padding in a
        next-token model's sentence: a sentence's positions that reach the loss are its words)."""
        allowed = self.allowed if restrict else torch.arange(self.model.vocab_size, device=x.device)
        if self.labels is None:
            allowed = allowed[allowed != self.model.pad_id]
        return allowed[nearest_tokens(x.detach(), self.embedding[allowed])]

    def rows(self, tokens: Tensor) -> Tensor:
        """Tokens ``(B, length)`` padded to the input's length."""
        return padded_rows(tokens.to(self.threat.device), self.threat.input_shape[0], self.model.pad_id)

    def read(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of the tokens read (a next-token model's with the token after them: ``completed``) and their
        labels."""
        rows = completed(self.observed, self.threat, self.rows(tokens))
        return rows, self.labels if self.labels is not None else next_token_targets(rows, self.model.pad_id)


def descend(x: Tensor, loss_of: Callable[[Tensor], Tensor], iterations: int, lr: float,
            after_step: Callable[[int, torch.optim.Adam], None] | None = None) -> list[float]:
    """Adam on ``x`` for ``iterations`` steps of ``loss_of(x)``, calling ``after_step(step, optimiser)`` after
    each (LAMP's discrete steps); the losses, one per step."""
    optimiser = torch.optim.Adam([x], lr=lr)
    trace = []
    for step in range(iterations):
        optimiser.zero_grad()
        loss = loss_of(x)
        x.grad, = torch.autograd.grad(loss, [x])
        optimiser.step()
        trace.append(loss.detach())
        if after_step is not None:
            after_step(step, optimiser)
    return torch.stack(trace).tolist() if trace else []


class Tag(Attack):
    """TAG (Deng et al. 2021): continuous input embeddings optimised so that their update matches the observed
    one in squared distance plus ``l1_weight`` times the absolute distance (the embedding's own gradient left
    out: the candidate feeds embeddings, not ids), then each position read as its nearest token by cosine. Where
    the update shares the embedding's gradient, the readout keeps to the token set it reveals (as LAMP can)."""
    attacker = HONEST_SERVER
    reads: ClassVar[tuple[str, ...]] = (FULL, NO_EMBEDDING, ADAPTERS)  # it matches whatever tensors the update shares

    name = "tag"
    paper = "Deng et al. 2021"
    modality = "text"
    params: ClassVar[dict[str, Param]] = {
        "iterations": Param(2500, int, min=1, help="Adam steps on the embeddings", budget=True),
        "lr": Param(0.01, float, min=0.0, help="Adam's step size"),
        "l1_weight": Param(0.01, float, min=0.0, help="weight of the absolute distance beside the squared one"),
        "use_token_set": Param(True, bool, help="read tokens only from the set the embedding's gradient reveals"),
    }
    brings: ClassVar[str] = "sentences from relaxed token embeddings"
    auto_params: ClassVar[dict[str, dict[str, Any]]] = optimiser_budgets()

    iterations: int
    lr: float
    l1_weight: float
    use_token_set: bool

    def unsupported(self, model: torch.nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        return not_a_token_model(model, f"{self.name} feeds embeddings to a transformer")

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        match = Matching(observed, threat, generator, self.l1_weight)
        x = match.start(1, generator)[0].requires_grad_(True)
        trace = descend(x, match.distance, self.iterations, self.lr)
        return Reconstruction(*match.read(match.tokens(x, self.use_token_set)), trace, 0.0)


class Bigram:
    """A bigram language model of token ids with add-``k`` smoothing, counted from sequences the attacker owns
    (the training split without the targets): LAMP's prior on word order, trained offline. The padding id stands
    for the start of a sentence. Counts are kept sparse (sorted pair keys), so a large vocabulary costs no more
    than the text it is counted from."""

    def __init__(self, sequences: Tensor, vocab_size: int, pad_id: int, k: float = 0.1,
                 device: torch.device | str = "cpu"):
        self.vocab_size, self.pad_id, self.k = vocab_size, pad_id, k
        seq = sequences.long().to(device)
        start = torch.full((len(seq), 1), pad_id, dtype=torch.long, device=seq.device)
        prev, nxt = torch.cat([start, seq[:, :-1]], 1), seq
        real = nxt != pad_id
        self.keys, self.pair_counts = torch.unique(prev[real] * vocab_size + nxt[real], return_counts=True)
        self.prev_counts = torch.bincount(prev[real], minlength=vocab_size)

    @classmethod
    def of_attacker(cls, threat: ThreatModel) -> Bigram | None:
        """The model counted from the attacker's own sentences (``ThreatModel.auxiliary``), on the attack's device;
        None where it has none."""
        own, model = threat.auxiliary, cast(Any, threat.model)
        if own is None or not len(own):
            return None
        return cls(own.images[own.indices], model.vocab_size, model.pad_id, device=threat.device)

    def nll(self, tokens: Tensor) -> Tensor:
        """Mean negative log-likelihood per token of each sequence ``(..., length)`` (log perplexity), on the
        device the model was counted on."""
        prev = torch.cat([torch.full_like(tokens[..., :1], self.pad_id), tokens[..., :-1]], -1)
        key = prev * self.vocab_size + tokens
        pair = torch.zeros(key.shape, dtype=torch.float64, device=key.device)
        if len(self.keys):  # no sentences counted: every pair unseen
            at = torch.searchsorted(self.keys, key).clamp_max(len(self.keys) - 1)
            pair = torch.where(self.keys[at] == key, self.pair_counts[at], 0).double()
        p = (pair + self.k) / (self.prev_counts[prev].double() + self.k * self.vocab_size)
        return (-p.log()).mean(-1)

    def log_table(self) -> Tensor:
        """``log P(next | previous)`` as a dense ``(vocab, vocab)`` table in float32 (row ``pad_id``: the start of
        a sentence), for vocabularies up to DENSE_PRIOR tokens."""
        v = self.vocab_size
        pairs = torch.zeros(v * v, dtype=torch.float64, device=self.prev_counts.device)
        pairs[self.keys] = self.pair_counts.double()
        table = (pairs.view(v, v) + self.k) / (self.prev_counts[:, None].double() + self.k * v)
        return table.log().float()

    def expected_nll(self, probabilities: Tensor, table: Tensor) -> Tensor:
        """The expected negative log-likelihood, summed over positions and sentences, of independent token
        distributions ``(B, length, vocab)`` (relaxed tokens), from ``log_table()``: differentiable in them."""
        first = probabilities[:, 0] @ table[self.pad_id]
        return -(first.sum() + torch.einsum("blv,vw,blw->", probabilities[:, :-1], table, probabilities[:, 1:]))


def reorderings(length: int, count: int, generator: torch.Generator) -> Tensor:
    """``count`` random reorderings ``(count, length)`` of a sentence's ``length`` (two or more) positions, LAMP's
    discrete moves, none of them the order as it is: half swap two tokens, half move a span of one or more tokens
    elsewhere (Balunovic et al. 2022, Sec. 4)."""
    out = torch.arange(length).repeat(count, 1)
    for row in out:
        i = int(torch.randint(length, (), generator=generator))
        j = (i + 1 + int(torch.randint(length - 1, (), generator=generator))) % length  # another position
        a, b = min(i, j), max(i, j)  # or the span [a, b), 1 to length - 1 tokens, moved to position c of the rest
        if torch.rand((), generator=generator) < 0.5:
            row[[i, j]] = row[[j, i]]
            continue
        rest = torch.cat([row[:a], row[b:]])
        c = int(torch.randint(len(rest), (), generator=generator))
        c += c >= a  # anywhere but where it was
        row[:] = torch.cat([rest[:c], row[a:b], rest[c:]])
    return out


class Lamp(Tag):
    """LAMP (Balunovic et al. 2022): TAG's continuous matching with a penalty that keeps each embedding at a
    token's length, alternated every ``every`` steps with a discrete step that tries ``candidates`` reorderings of
    one sentence (swapped tokens, moved spans) and keeps the one whose update matches best and whose words a
    language model finds most likely. The language model is a bigram model counted from the attacker's own
    sentences (the training split without the targets). The discrete steps run in the second half of the
    iterations, once the nearest tokens have settled: from the start, a prior read on unsettled tokens steered the
    embeddings away, below TAG (docs/results.md)."""

    name = "lamp"
    paper = "Balunovic et al. 2022"
    params: ClassVar[dict[str, Param]] = {
        **Tag.params,
        **DISCRETE_STEPS,
        "lm_weight": Param(0.2, float, min=0.0, help="weight of the language model's log perplexity beside the "
                           "log matching loss when reorderings are ranked"),
        "embedding_weight": Param(0.01, float, min=0.0, help="weight of the penalty on embeddings whose length "
                                  "strays from a token's mean length"),
        "starts": Param(8, int, min=1, help="random starts, the best-matching kept (LAMP's initialisation)"),
    }
    brings: ClassVar[str] = "word order from a language model beside the gradient"

    every: int
    candidates: int
    lm_weight: float
    embedding_weight: float
    starts: int

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        match = Matching(observed, threat, generator, self.l1_weight)
        prior = Bigram.of_attacker(threat)
        starts = match.start(self.starts, generator)
        x = starts[int(torch.stack([match.distance(s, False) for s in starts]).argmin())].requires_grad_(True)
        moves = 0

        def discrete(step: int, optimiser: torch.optim.Adam) -> None:
            nonlocal moves
            if reorder_due(step, self.every, self.iterations, match.length):
                moves += self._discrete_step(x, optimiser, match, prior, generator)

        trace = descend(x, lambda v: match.distance(v) + self.embedding_weight * ((v.norm(dim=-1) - match.scale) ** 2)
                        .mean(), self.iterations, self.lr, discrete)
        extras: dict[str, Any] = {"reorderings": moves}
        if prior is None:
            extras["note"] = "no sentences of the attacker's own (ThreatModel.auxiliary): reorderings ranked by the match alone"
        return Reconstruction(*match.read(match.tokens(x, self.use_token_set)), trace, 0.0, extras)

    def _discrete_step(self, x: Tensor, optimiser: torch.optim.Adam, match: Matching, prior: Bigram | None,
                       generator: torch.Generator) -> bool:
        """Reorder one sentence of ``x`` by its best reordering (``reorder``), ranked by the log matching loss plus
        ``lm_weight`` times the prior's log perplexity of the words it reads."""
        def score(sentence: int, orders: Tensor) -> Tensor:
            def matched(order: Tensor) -> Tensor:
                return match.distance(reordered(x, sentence, order), False).clamp_min(1e-30).log()

            total = torch.stack([matched(o) for o in orders])
            if prior is not None and self.lm_weight:  # each position keeps its nearest token when reordered
                total = total + self.lm_weight * prior.nll(match.tokens(x[sentence], self.use_token_set)[orders])
            return total

        return reorder(x, optimiser, score, match.length, self.candidates, generator)


def reordered(x: Tensor, sentence: int, order: Tensor) -> Tensor:
    """A copy of ``x`` ``(B, length, ...)`` with sentence ``sentence``'s positions in ``order``."""
    moved = x.detach().clone()
    moved[sentence] = moved[sentence, order]
    return moved


def reorder_due(step: int, every: int, iterations: int, length: int) -> bool:
    """Whether a discrete step follows continuous step ``step``: every ``every`` steps of the second half, once the
    nearest tokens have settled, for sentences of two or more tokens."""
    return (step + 1) % every == 0 and 2 * (step + 1) > iterations and length > 1


def reorder(x: Tensor, optimiser: torch.optim.Adam, score: Callable[[int, Tensor], Tensor], length: int,
            candidates: int, generator: torch.Generator) -> bool:
    """LAMP's discrete step: one sentence of ``x`` ``(B, length, ...)``, drawn at random, and Adam's moments with
    it, moved to the best of ``candidates`` reorderings by ``score(sentence, orders)`` (lower is better; row 0 of
    ``orders`` is the order it has) where that beats the order it has; whether it moved."""
    cpu = torch.Generator().manual_seed(int(torch.randint(2 ** 62, (), generator=generator, device=generator.device)))
    sentence = int(torch.randint(len(x), (), generator=cpu))
    orders = torch.cat([torch.arange(length)[None], reorderings(length, candidates, cpu)]).to(x.device)
    best = int(score(sentence, orders).argmin())
    if best == 0:
        return False
    with torch.no_grad():
        for tensor in [x, *(v for v in optimiser.state[x].values() if v.shape == x.shape)]:
            tensor[sentence] = tensor[sentence, orders[best]].clone()
    return True


class SoftTokens(nn.Module):
    """A language model fed a distribution over its vocabulary at each position ``(B, length, vocab)``: the input is
    the distribution's mean token embedding, computed from the model's own embedding weight, so that the weight's
    gradient is a relaxed token set and a protocol's local steps move it as they move the client's. A one-hot
    distribution gives the update of the token ids exactly for sentences that fill the input (no padding mask is
    built for embeddings: a shorter sentence of a batch is read as if unpadded, as TAG reads it)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, probabilities: Tensor) -> Tensor:
        model: Any = self.model
        embedding = reduce(getattr, model.embedding_name().split("."), model)  # functional_call's stand-in too
        return model(probabilities @ embedding)


class BayesText(Attack):
    """The Bayes adversary (Balunovic et al. 2022) on a language model: relaxed tokens, one distribution over the
    vocabulary per position (a softmax of free logits), optimised to maximise the audited defense's own
    ``log p(g | x)`` of the whole update, the token embedding's gradient included (the relaxation makes it
    differentiable), under FedSGD or the protocol's local steps; each position is then read as its most likely
    token. With ``prior_weight`` above 0 it weighs a prior on sentences beside the likelihood, as the Bayes
    adversary does: a bigram model counted from the attacker's own sentences (``ThreatModel.auxiliary``, as
    LAMP's), in its expectation over the relaxed tokens and, in the discrete steps, on the sentences read. The
    prior joins only where the defense draws noise, so that its likelihood is a density (a deterministic
    defense's zero-noise limit is matched alone). It is off by default: at weight 1 it did not help reliably
    (docs/results.md)."""
    attacker = HONEST_SERVER

    name = "bayes_text"
    paper = "Balunovic et al. 2022"
    modality = "text"
    uses_defense = True
    uses_likelihood = True
    params: ClassVar[dict[str, Param]] = {
        "iterations": Param(2500, int, min=1, help="Adam steps on the relaxed tokens' logits", budget=True),
        "lr": Param(0.1, float, min=0.0, exclusive_min=True, help="Adam's step size"),
        "init_scale": Param(0.1, float, min=0.0, help="standard deviation of the logits' random start (0: uniform "
                            "distributions)"),
        "prior_weight": Param(0.0, float, min=0.0, help="weight of the bigram prior's log-probability beside the "
                              "log-likelihood (0: the likelihood alone; 1: the posterior under that prior)"),
        **DISCRETE_STEPS,
    }
    brings: ClassVar[str] = "the defense's own likelihood p(g|x) on relaxed tokens"
    auto_params: ClassVar[dict[str, dict[str, Any]]] = optimiser_budgets()

    iterations: int
    lr: float
    init_scale: float
    prior_weight: float
    every: int
    candidates: int

    def unsupported(self, model: torch.nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        return not_a_token_model(model, "bayes_text feeds relaxed tokens to a transformer")

    def unsupported_defense(self, defense: Defense) -> str | None:
        if defense.has_likelihood():
            return None
        return f"bayes_text: defense {defense.name!r} declares no log_likelihood"

    def _prior(self, threat: ThreatModel, extras: dict[str, Any]) -> tuple[Bigram, Tensor] | None:
        """The bigram prior and its dense table, where it applies; None, with a note, where it does not."""
        model: Any = threat.model
        why = ("prior_weight is 0" if not self.prior_weight else
               "the defense is deterministic: its likelihood is a zero-noise limit, not a density"
               if threat.defense.deterministic else
               f"the vocabulary has {model.vocab_size} tokens, more than a dense table's {DENSE_PRIOR}"
               if model.vocab_size > DENSE_PRIOR else None)
        bigram = None if why else Bigram.of_attacker(threat)
        if bigram is None:
            extras["prior"] = "none: " + (why or "no sentences of the attacker's own (ThreatModel.auxiliary)")
            return None
        extras["prior"] = f"bigram of {len(cast(Any, threat.auxiliary))} sentences, weight {self.prior_weight:g}"
        return bigram, bigram.log_table()

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        model: Any = threat.model
        relaxed = replace(threat, model=SoftTokens(model))
        lm = predicts_next_token(model)
        labels = None if lm else text_labels(observed, threat, generator)
        observed = observed.to(threat.device)
        length = sequence_length(observed, model, threat.input_shape[0])
        length = min(length + 1, threat.input_shape[0]) if lm else length  # a last token that only the head reads
        logits = self.init_scale * torch.randn((observed.batch_size, length, model.vocab_size), generator=generator,
                                               device=generator.device).to(threat.device)
        logits.requires_grad_(True)
        extras: dict[str, Any] = {}
        prior = self._prior(threat, extras)

        def negative_log_posterior(z: Tensor) -> Tensor:
            p = z.softmax(-1)
            targets = relaxed_targets(p, model.pad_id) if labels is None else labels
            loss = -threat.defense.log_likelihood(observed, threat.defense.candidate_update(relaxed, p, targets))
            return loss if prior is None else loss + self.prior_weight * prior[0].expected_nll(p, prior[1])

        def score(sentence: int, orders: Tensor) -> Tensor:
            """The posterior of the sentences read (each position's likeliest token), the one reordered."""
            read = logits.detach().argmax(-1)

            def moved(order: Tensor) -> Tensor:
                with torch.enable_grad():  # the candidate update is a gradient, of the model's parameters
                    tokens = one_hot_logits(reordered(read, sentence, order), model.vocab_size)
                    return negative_log_posterior(tokens).detach()
            return torch.stack([moved(o) for o in orders])

        moves = 0

        def discrete(step: int, optimiser: torch.optim.Adam) -> None:
            nonlocal moves
            if reorder_due(step, self.every, self.iterations, length):
                moves += reorder(logits, optimiser, score, length, self.candidates, generator)

        trace = descend(logits, negative_log_posterior, self.iterations, self.lr, discrete)
        rows = padded_rows(logits.detach().argmax(-1), threat.input_shape[0], model.pad_id)
        labels = next_token_targets(rows, model.pad_id) if labels is None else labels
        return Reconstruction(rows, labels, trace, 0.0, {"reorderings": moves, **extras})


def one_hot_logits(tokens: Tensor, vocab_size: int) -> Tensor:
    """Logits whose softmax is, to float precision, the one-hot distribution of ``tokens``."""
    return torch.nn.functional.one_hot(tokens, vocab_size).to(torch.get_default_dtype()) * 1e4


def nearest_tokens(x: Tensor, table: Tensor) -> Tensor:
    """For each vector of ``x`` ``(..., width)``, the row of ``table`` ``(tokens, width)`` of highest cosine."""
    return (torch.nn.functional.normalize(x, dim=-1) @ torch.nn.functional.normalize(table, dim=-1).T).argmax(-1)


@hookimpl
def register_attacks():
    return [TokenSet, Dager, AdapterSpan, Tag, Lamp, BayesText]
