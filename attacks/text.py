"""Attacks on the updates of language models: the tokens from the embedding's gradient (Melis et al. 2019), DAGER's
exact recovery of whole sequences from the span of the first attention layers' gradients (Petrov et al. 2024), and
TAG's optimisation of relaxed embeddings (Deng et al. 2021)."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from leakaudit.attacks.labels import recover_labels
from leakaudit.plugins import hookimpl
from leakaudit.plugins.attack import Attack, Reconstruction, ThreatModel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import Protocol, not_one_step
from leakaudit.plugins.spec import Param
from leakaudit.plugins.text import TokenModel

#: Sequences whose second-layer inputs are computed at once while growing prefixes (bounds the memory).
CHUNK = 4096
#: The least drop between consecutive singular values that separates a gradient's span from its rounding.
GAP = 10.0
#: Rows of the room left in the span below the width: a gradient of rank within this of the width spans
#: (nearly) every vector, and its filters pass anything (DAGER caps its rank at the width less 20 for GPT-2's 768).
RANK_MARGIN = 4


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
    right singular vectors down to the spectrum's largest drop (by ten or more from one singular value to the
    next) that starts above ``floor`` times the largest; where there is none, those above the floor."""
    _, s, vh = torch.linalg.svd(gradient.double(), full_matrices=False)
    above = int((s > floor * s[0]).sum())
    upper = s[:min(above, len(s) - 1)]
    drops = upper / s[1:len(upper) + 1].clamp_min(1e-300)
    rank = above if len(drops) == 0 or drops.max() < GAP else int(drops.argmax()) + 1
    return vh[:rank]


def span_distance(vectors: Tensor, basis: Tensor) -> Tensor:
    """How far each vector ``(..., width)``, scaled to unit length, lies from the span: its residual's norm."""
    v = vectors.double()
    v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return (v - (v @ basis.T) @ basis).norm(dim=-1)


def token_rows(tokens: Tensor, model: Any, batch: int, length: int, device: torch.device) -> Tensor:
    """The tokens, unordered, in every row of the batch (padding left out; the rest padded): what the embedding's
    gradient gives without an order."""
    tokens = tokens[tokens != model.pad_id][:length].to(device)
    rows = torch.full((batch, length), model.pad_id, dtype=torch.long, device=device)
    rows[:, : len(tokens)] = tokens
    return rows


class TokenSet(Attack):
    """The batch's words from the token embedding's gradient (Melis et al. 2019): its rows are zero but for the
    tokens the batch holds, where the embedding is untied. Every row gets the set, largest gradient first, with no
    order; under noise, the rows of largest norm, as many as the batch's positions. Frozen embeddings (FILM) share
    no such gradient: it then reads nothing."""

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
        if not isinstance(model, TokenModel):
            return "token_set reads a language model's embedding: the model is not a TokenModel (leakaudit.plugins.text)"
        return None

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        model: Any = threat.model
        length, batch = threat.input_shape[0], observed.batch_size
        rows = token_rows(token_set(observed, model, self.tolerance), model, batch, length, threat.device)
        extras: dict[str, Any] = {"tokens": int((rows[0] != model.pad_id).sum())}  # what one row holds
        if model.embedding_name() not in observed.names:
            extras["note"] = "the update shares no gradient of the token embedding (frozen): no tokens to read"
        return Reconstruction(rows, recover_labels(observed, threat, "signs", generator), [], 0.0, extras)


class Dager(Attack):
    """DAGER (Petrov et al. 2024) for causal models: the tokens whose first-layer input lies in the span of the
    first attention weight's gradient, at each position; then sequences grown token by token, keeping each
    prefix whose second-layer input lies in the second layer's span. Exact while the batch's tokens are fewer
    than the width; where they are not, it says "rank condition not met" and returns the token set instead."""

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
        "max_prefixes": Param(2_000, int, min=1, help="prefixes kept per step (the closest first)"),
    }
    brings: ClassVar[str] = "exact sequences from the span of attention gradients"
    noise_free_only: ClassVar[bool] = True
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {}}  # linear algebra: no budget to set

    first_tolerance: float
    second_tolerance: float
    rank_floor: float
    max_prefixes: int

    def unsupported(self, model: torch.nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if not isinstance(model, TokenModel):
            return "dager reads a transformer's layers: the model is not a TokenModel (leakaudit.plugins.text)"
        if not model.causal:
            return "dager here searches causal models only; the encoders' exhaustive search is not built"
        if model.depth < 3:
            # the last layer's gradient reaches each sequence through its one read position: its span is
            # too narrow to hold every position's input
            return f"dager reads the second layer's span, which needs a layer after it: the model has {model.depth}"
        return not_one_step(protocol, batch_size, "dager")

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        model: Any = threat.model
        length, batch = threat.input_shape[0], observed.batch_size
        first = span_basis(gradient_of(observed, model.attention_name(0)), self.rank_floor)
        second = span_basis(gradient_of(observed, model.attention_name(1)), self.rank_floor)
        extras: dict[str, Any] = {"rank": [len(first), len(second)], "width": model.width}
        with torch.no_grad():
            if max(len(first), len(second)) > model.width - RANK_MARGIN:
                extras["note"] = (f"rank condition not met: the attention gradients have rank {len(first)} and "
                                  f"{len(second)} of width {model.width} (the batch's tokens are not fewer than the "
                                  "width), so their span holds any sequence; the token set is returned")
                rows = token_rows(token_set(observed, model), model, batch, length, threat.device)
            else:
                candidates = self._candidates(model, first, length, threat.device)
                rows = self._grow(model, second, candidates, batch, length, threat.device)
        return Reconstruction(rows, recover_labels(observed, threat, "signs", generator), [], 0.0, extras)

    def _candidates(self, model: Any, basis: Tensor, length: int, device: torch.device) -> list[Tensor]:
        """Per position, the ids whose first-layer input there lies in the span (closest first)."""
        ids = torch.arange(model.vocab_size, device=device)[:, None].expand(model.vocab_size, length)
        distance = span_distance(model.layer_inputs(ids, 0), basis.to(device))  # (vocab, length)
        out = []
        for p in range(length):
            passing = torch.nonzero(distance[:, p] < self.first_tolerance).flatten()
            out.append(passing[distance[passing, p].argsort()])
        return out

    def _grow(self, model: Any, basis: Tensor, candidates: list[Tensor], batch: int, length: int,
              device: torch.device) -> Tensor:
        """Sequences grown position by position: a prefix extended by each candidate whose second-layer input
        lies in the span; a prefix that no candidate extends is a finished sequence."""
        basis = basis.to(device)
        prefixes, finished = candidates[0][:, None], list[Tensor]()
        for p in range(1, length):
            if len(prefixes) == 0 or len(candidates[p]) == 0:
                break
            grown = torch.cat([prefixes.repeat_interleave(len(candidates[p]), 0),
                               candidates[p].repeat(len(prefixes))[:, None]], dim=1)
            distance = torch.cat([span_distance(model.layer_inputs(part, 1)[:, -1], basis)
                                  for part in grown.split(CHUNK)])
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

class Tag(Attack):
    """TAG (Deng et al. 2021): continuous input embeddings optimised so that their update matches the observed
    one in squared distance plus ``l1_weight`` times the absolute distance (the embedding's own gradient left
    out: the candidate feeds embeddings, not ids), then each position read as its nearest token by cosine. Where
    the update shares the embedding's gradient, the readout keeps to the token set it reveals (as LAMP can)."""

    name = "tag"
    paper = "Deng et al. 2021"
    modality = "text"
    params: ClassVar[dict[str, Param]] = {
        "iterations": Param(2500, int, min=1, help="Adam steps on the embeddings"),
        "lr": Param(0.01, float, min=0.0, help="Adam's step size"),
        "l1_weight": Param(0.01, float, min=0.0, help="weight of the absolute distance beside the squared one"),
        "use_token_set": Param(True, bool, help="read tokens only from the set the embedding's gradient reveals"),
    }
    brings: ClassVar[str] = "sentences from relaxed token embeddings"
    #: 300 steps read a 14-token sentence back on a 2-layer model (tests/test_text.py); a GPU affords the paper's.
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {"iterations": 300}, "cuda": {"iterations": 2500}}

    iterations: int
    lr: float
    l1_weight: float
    use_token_set: bool

    def unsupported(self, model: torch.nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if not isinstance(model, TokenModel):
            return "tag feeds embeddings to a transformer: the model is not a TokenModel (leakaudit.plugins.text)"
        return None

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        model: Any = threat.model
        embedding = dict(model.named_parameters())[model.embedding_name()]
        named = [(n, p) for n, p in model.named_parameters() if n in observed.names and n != model.embedding_name()]
        targets = [gradient_of(observed, n).to(threat.device) for n, _ in named]
        labels = recover_labels(observed, threat, "signs", generator)  # the head's bias gradient (iDLG)
        scale = embedding.detach().norm(dim=1).mean()
        length = sequence_length(observed, model, threat.input_shape[0])
        start = torch.randn((observed.batch_size, length, model.width), generator=generator,
                            device=generator.device).to(threat.device)
        x = (start * scale / start.norm(dim=-1, keepdim=True)).requires_grad_(True)
        optimiser = torch.optim.Adam([x], lr=self.lr)
        trace = []
        for _ in range(self.iterations):
            optimiser.zero_grad()
            grads = torch.autograd.grad(threat.loss_fn(model(x), labels), [p for _, p in named], create_graph=True)
            loss = torch.stack([((g - t) ** 2).sum() + self.l1_weight * (g - t).abs().sum()
                                for g, t in zip(grads, targets)]).sum()
            x.grad, = torch.autograd.grad(loss, [x])
            optimiser.step()
            trace.append(loss.detach())
        allowed = (token_set(observed, model) if self.use_token_set and model.embedding_name() in observed.names
                   else torch.arange(model.vocab_size)).to(threat.device)
        rows = torch.full((observed.batch_size, threat.input_shape[0]), model.pad_id, dtype=torch.long,
                          device=threat.device)
        rows[:, :length] = allowed[nearest_tokens(x.detach(), embedding.detach()[allowed])]
        return Reconstruction(rows, labels, torch.stack(trace).tolist() if trace else [], 0.0)


def nearest_tokens(x: Tensor, table: Tensor) -> Tensor:
    """For each vector of ``x`` ``(..., width)``, the row of ``table`` ``(tokens, width)`` of highest cosine."""
    return (torch.nn.functional.normalize(x, dim=-1) @ torch.nn.functional.normalize(table, dim=-1).T).argmax(-1)


@hookimpl
def register_attacks():
    return [TokenSet, Dager, Tag]
