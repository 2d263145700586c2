"""Text for audits, offline: sentences with personal data a client would type, a real corpus (sentences of the
Python documentation, PSF License), a word tokenizer, and small transformers of GPT-2's (causal) and BERT's
(bidirectional) architecture, sized by their params."""
from __future__ import annotations

import math
import random
import re
from typing import Any
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.components import DatasetSpec, Metric, ModelSpec
from leakaudit.plugins.text import TASKS, TokenData, decode_tokens, next_token_targets

PAD, UNK = "<pad>", "<unk>"

# Made-up values from short lists, so that every word of a test sentence is in the training vocabulary; the
# numbers are drawn digit by digit and tokenized one digit a token, as GPT-2's tokenizer splits most numbers.
FIRST = ("maria", "james", "aisha", "wei", "olga", "pedro", "fatima", "liam", "yuki", "noah", "sara", "omar",
         "elena", "david", "priya", "lucas", "mei", "ahmed", "anna", "tom")
LAST = ("lopez", "smith", "khan", "chen", "ivanova", "garcia", "ali", "murphy", "tanaka", "brown", "rossi",
        "haddad", "novak", "cohen", "patel", "silva", "wong", "hassan", "berg", "clark")
STREETS = ("oak", "maple", "station", "mill", "church", "park", "river", "hill", "king", "market")
CITIES = ("leeds", "porto", "lyon", "graz", "malmo", "turin", "ghent", "cork", "bergen", "brno")

#: Intent classes and their sentence templates ({first} {last} {phone} {card} {account} {number} {street} {city}).
TEMPLATES: dict[str, tuple[str, ...]] = {
    "payment": ("please charge my card {card} thanks", "my card number is {card}",
                "use card {card} for the order"),
    "contact": ("call me at {phone} ask for {first}", "this is {first} {last} my number is {phone}",
                "text {first} on {phone} please"),
    "address": ("ship it to {number} {street} street {city}", "i live at {number} {street} road in {city}",
                "send the parcel to {first} {last} {number} {street} street"),
    "banking": ("move the rent to account {account}", "my account is {account} under {first} {last}",
                "pay {first} into account {account}"),
}


def _digits(rng: random.Random, count: int) -> str:
    return " ".join(str(rng.randrange(10)) for _ in range(count))


def pii_sentence(rng: random.Random) -> tuple[str, int, list[str]]:
    """One sentence, its intent class and the personal values in it (as they read in the tokenized sentence)."""
    label = rng.randrange(len(TEMPLATES))
    template = rng.choice(TEMPLATES[list(TEMPLATES)[label]])
    values = {"first": rng.choice(FIRST), "last": rng.choice(LAST), "phone": _digits(rng, 7),
              "card": _digits(rng, 8), "account": _digits(rng, 6), "number": str(rng.randrange(1, 100)),
              "street": rng.choice(STREETS), "city": rng.choice(CITIES)}
    used = re.findall(r"{(\w+)}", template)
    personal = [" ".join(tokenize(values[k])) for k in used
                if k in ("first", "last", "phone", "card", "account", "number")]
    return template.format(**values), label, personal


def tokenize(sentence: str) -> list[str]:
    """Lower-case words, digits one by one, punctuation apart."""
    return re.findall(r"[a-z]+|\d|[^\sa-z\d]", sentence.lower())


def vocabulary(sentences: list[str]) -> list[str]:
    """The padding and unknown tokens, then every word of ``sentences`` by first appearance."""
    words = dict.fromkeys([PAD, UNK, *(w for s in sentences for w in tokenize(s))])
    return list(words)


def encode(sentences: list[str], words: list[str], length: int) -> Tensor:
    """Token ids ``(N, length)``: each sentence cut to ``length`` tokens and padded at its end."""
    index = {w: i for i, w in enumerate(words)}
    out = torch.zeros(len(sentences), length, dtype=torch.long)  # PAD is id 0
    for row, s in enumerate(sentences):
        ids = [index.get(w, 1) for w in tokenize(s)][:length]
        out[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def token_data(name: str, x: Tensor, classes: Tensor, num_classes: int, words: list[str], train: int, task: str,
               pii: list[list[str]] | None = None) -> TokenData:
    """Token rows split at ``train``, labelled for ``task``: their classes, or their next tokens (a keyboard's)."""
    if task not in TASKS:
        raise ValueError(f"{name}: task must be one of {', '.join(TASKS)}, got {task!r}")
    y, count = (classes, num_classes) if task == "classify" else (next_token_targets(x, 0), len(words))
    pii = pii or []
    return TokenData(name, x[:train], y[:train], x[train:], y[train:], count, words, train_pii=pii[:train],
                     test_pii=pii[train:], task=task)


def load_pii_sentences(length: int = 24, train: int = 2000, test: int = 200, seed: int = 0,
                       task: str = "classify") -> TokenData:
    """Sentences a client would type to an assistant (payments, contacts, addresses, banking), made up from a
    seeded generator (no real person's data), tokenized by a vocabulary built from the training split; labelled
    by their intent, or under ``task: next_token`` by their next words, as a keyboard learns them."""
    rng = random.Random(seed)
    rows = [pii_sentence(rng) for _ in range(train + test)]
    sentences = [s for s, _, _ in rows]
    words = vocabulary(sentences[:train])
    y = torch.tensor([label for _, label, _ in rows], dtype=torch.long)
    return token_data("pii_sentences", encode(sentences, words, length), y, len(TEMPLATES), words, train, task,
                      [p for _, _, p in rows])


#: The corpus file: one sentence a line after its topic and a tab; its header says where it comes from, its licence
#: (PSF-LICENSE.txt beside it) and how it was cut.
CORPUS = Path(__file__).with_name("data") / "python_reference.tsv"


def load_python_reference(length: int = 24, test: int = 60, seed: int = 0, task: str = "classify") -> TokenData:
    """Sentences of the Python documentation, a real English corpus (365 sentences of the reference pages that
    Python's ``help()`` shows; PSF License 2), each classed by the page it comes from (8 pages), shuffled by
    ``seed`` and split, the last ``test`` for testing. Its words are tokenized by a vocabulary built from the
    training split (test words outside it read ``<unk>``); the sentences hold no personal values. Under ``task:
    next_token`` they are labelled by their next words instead of their page."""
    lines = [line.split("\t", 1) for line in CORPUS.read_text(encoding="utf-8").splitlines()
             if line and not line.startswith("#")]
    pages = list(dict.fromkeys(page for page, _ in lines))
    if not 0 < test < len(lines):
        raise ValueError(f"python_reference: test must be between 1 and {len(lines) - 1} (it has {len(lines)} "
                         f"sentences), got {test}")
    order = torch.randperm(len(lines), generator=torch.Generator().manual_seed(seed)).tolist()
    sentences = [lines[i][1] for i in order]
    y = torch.tensor([pages.index(lines[i][0]) for i in order], dtype=torch.long)
    train = len(lines) - test
    words = vocabulary(sentences[:train])
    return token_data("python_reference", encode(sentences, words, length), y, len(pages), words, train, task)


class Block(nn.Module):
    """A pre-norm transformer block (GPT-2's order): attention with one fused query-key-value projection, then
    an MLP four times the width."""

    def __init__(self, width: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def attend(self, x: Tensor, mask: Tensor | None) -> Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        if self.causal:
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        if mask is not None:  # padding keys are not attended to
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.attend(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class TinyTransformer(nn.Module):
    """A small sequence classifier of GPT-2's architecture (``causal``: the last real token's state is read) or
    BERT's (bidirectional, padding masked, the first token's state is read); with ``next_token``, a causal
    language model whose head gives every position's next-token logits, ``(B, vocab, T)`` (the class dimension
    second, as torch's cross-entropy takes per-position classes). Takes token ids ``(B, T)``, or embeddings
    ``(B, T, width)`` for attacks that optimise them (no padding then)."""

    def __init__(self, vocab_size: int, num_classes: int, length: int, width: int = 128, layers: int = 4,
                 heads: int = 4, causal: bool = True, pad_id: int = 0, next_token: bool = False):
        super().__init__()
        causal = causal or next_token  # a language model reads each position from the ones before it
        self.width, self.vocab_size, self.depth, self.causal, self.pad_id = width, vocab_size, layers, causal, pad_id
        self.predicts_next_token = next_token
        self.wte, self.wpe = nn.Embedding(vocab_size, width), nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads, causal) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab_size if next_token else num_classes)
        for p in self.parameters():  # GPT-2's initialisation
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def _embed(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        # through the module, one row of positions per example, so that Opacus sees each example's use of them
        positions = self.wpe(torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1))
        if x.dtype == torch.long:
            return self.wte(x) + positions, x != self.pad_id
        return x + positions, None

    def layer_inputs(self, ids: Tensor, layer: int) -> Tensor:
        """What block ``layer``'s query-key-value projection reads at each position (``TokenModel``)."""
        h, mask = self._embed(ids)
        for block in self.blocks[:layer]:
            h = block(h, None if self.causal else mask)
        last: Any = self.blocks[layer]
        return last.ln_1(h)

    def attention_name(self, layer: int) -> str:
        return f"blocks.{layer}.qkv.weight"

    def embedding_name(self) -> str:
        return "wte.weight"

    def position_name(self) -> str:
        return "wpe.weight"

    def forward(self, x: Tensor) -> Tensor:
        h, mask = self._embed(x)
        for block in self.blocks:
            h = block(h, None if self.causal else mask)
        h = self.ln_f(h)
        if self.predicts_next_token:  # padding needs no mask: it comes last, and predicts nothing
            return self.head(h).transpose(1, 2)
        if not self.causal:
            return self.head(h[:, 0])
        last = (mask.sum(1) - 1).clamp_min(0) if mask is not None else torch.full((len(h),), h.shape[1] - 1)
        return self.head(h[torch.arange(len(h), device=h.device), last.to(h.device)])


def rouge(rec: Tensor, orig: Tensor, key: str = "rouge1", pad_id: int = 0) -> Tensor:
    """ROUGE F-measure (Lin 2004; torchmetrics' offline scorer) per sequence, ``key`` one of rouge1, rouge2,
    rougeL: the unigram, bigram or longest-common-subsequence overlap of each recovered sequence with its
    original, on token ids (so on the tokenizer's tokens)."""
    from torchmetrics.functional.text.rouge import rouge_score

    def ids(seq: Tensor) -> str:  # the ids themselves as words, so that the scorer splits the tokenizer's tokens
        return decode_tokens(seq, None, pad_id)

    return torch.tensor([float(rouge_score(ids(r), ids(o), rouge_keys=key)[f"{key}_fmeasure"])
                         for r, o in zip(rec, orig)])


def token_accuracy(rec: Tensor, orig: Tensor, pad_id: int = 0) -> Tensor:
    """The share of each original's tokens recovered at their position (padding left out)."""
    real = orig != pad_id
    return ((rec == orig) & real).sum(1) / real.sum(1).clamp_min(1)


def exact_sequence(rec: Tensor, orig: Tensor) -> Tensor:
    """1 where the whole sequence came back, padding included, else 0."""
    return (rec == orig).all(1).float()


def pii_recall(recovered: list[str], personal: list[list[str]]) -> float | None:
    """The share of the personal values in the clients' sentences that come back verbatim in the recovered
    sentence of the same client (1: every name and number leaked; 0: none); None where they hold none."""
    total = sum(len(values) for values in personal)
    found = sum(value in text for text, values in zip(recovered, personal) for value in values)
    return found / total if total else None


def text_assignment(rec: Tensor, orig: Tensor, pad_id: int = 0) -> Tensor:
    """Permutation ``p`` so that ``rec[p]`` lines up with ``orig`` at the highest total ROUGE-1 (the order DAGER and
    LAMP score in: a batch's sequences come back unordered)."""
    from scipy.optimize import linear_sum_assignment

    if len(rec) == 1:
        return torch.zeros(1, dtype=torch.long)
    score = torch.stack([rouge(r.expand_as(orig), orig, "rouge1", pad_id) for r in rec])  # (rec, orig)
    rows, cols = linear_sum_assignment(score.numpy(), maximize=True)
    order = torch.empty(len(orig), dtype=torch.long)
    order[torch.as_tensor(cols)] = torch.as_tensor(rows)
    return order


def classification_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Softmax cross-entropy of the sequence's class."""
    return F.cross_entropy(logits, labels)


def rouge1(rec: Tensor, orig: Tensor) -> Tensor:
    """ROUGE-1 F-measure per sequence: the unigram overlap of the recovered sequence with its original."""
    return rouge(rec, orig, "rouge1")


def rouge2(rec: Tensor, orig: Tensor) -> Tensor:
    """ROUGE-2 F-measure per sequence: the bigram overlap of the recovered sequence with its original."""
    return rouge(rec, orig, "rouge2")


def rougeL(rec: Tensor, orig: Tensor) -> Tensor:  # noqa: N802 - the metric's own name
    """ROUGE-L F-measure per sequence: the longest common subsequence of the recovered sequence and its original."""
    return rouge(rec, orig, "rougeL")


def _loader(load):
    """A text loader as a DatasetSpec calls it (the image keywords ignored: text has none)."""
    def call(image_size: int | None = None, root: str | None = None, download: bool = False, **params) -> TokenData:
        return load(**params)
    return call


def _model(causal: bool, next_token: bool = False):
    def build(vocab_size: int, num_classes: int, length: int, width: int = 128, layers: int = 4,
              heads: int = 4) -> TinyTransformer:
        return TinyTransformer(vocab_size, num_classes, length, width=width, layers=layers, heads=heads,
                               causal=causal, next_token=next_token)
    return build


TEXT_MODEL_PARAMS = {"width": Param(128, int, min=8, help="embedding width (a multiple of heads)"),
                     "layers": Param(4, int, min=1, help="transformer blocks"),
                     "heads": Param(4, int, min=1, help="attention heads per block")}


@hookimpl
def register_datasets():
    length = Param(24, int, min=2, help="tokens per sequence, padding included (longer sentences are cut)")
    task = Param("classify", str, choices=TASKS, help="the labels: each sentence's class, or its next tokens "
                 "(next_token: a keyboard's language model, tiny_gpt_lm)")
    return [DatasetSpec("pii_sentences", _loader(load_pii_sentences), {
        "length": length,
        "train": Param(2000, int, min=1, help="training sentences"),
        "test": Param(200, int, min=1, help="test sentences"),
        "seed": Param(0, int, min=0, help="the generator's seed"),
        "task": task},
        summary=load_pii_sentences.__doc__.splitlines()[0], values=lambda s: 0, modality="text"),
        DatasetSpec("python_reference", _loader(load_python_reference), {
            "length": length,
            "test": Param(60, int, min=1, max=364, help="test sentences (of 365)"),
            "seed": Param(0, int, min=0, help="the seed of the shuffle before the split"),
            "task": task},
            summary="sentences of the Python documentation, a real English corpus (PSF License), classed by "
                    "their page", values=lambda s: 0, modality="text")]


@hookimpl
def register_models():
    return [ModelSpec("tiny_gpt", _model(True), TEXT_MODEL_PARAMS, summary="a small causal transformer classifier "
                      "of GPT-2's architecture", paper="Radford et al. 2019", modality="text"),
            ModelSpec("tiny_bert", _model(False), TEXT_MODEL_PARAMS, summary="a small bidirectional transformer "
                      "classifier of BERT's architecture", paper="Devlin et al. 2019", modality="text"),
            ModelSpec("tiny_gpt_lm", _model(True, next_token=True), TEXT_MODEL_PARAMS, summary="a small causal "
                      "language model of GPT-2's architecture, trained on the next token (a keyboard's)",
                      paper="Radford et al. 2019", modality="text", task="next_token")]


@hookimpl
def register_metrics():
    return [Metric("rouge1", rouge1, True, summary=rouge1.__doc__, margin=0.1, view_rank=1, modality="text"),
            Metric("rouge2", rouge2, True, summary=rouge2.__doc__, margin=0.1, view_rank=0, modality="text"),
            Metric("rougeL", rougeL, True, summary=rougeL.__doc__, margin=0.1, modality="text"),
            Metric("token_accuracy", token_accuracy, True, summary=token_accuracy.__doc__, margin=0.1,
                   modality="text", distance_rank=2),
            Metric("exact_sequence", exact_sequence, True, summary=exact_sequence.__doc__, margin=0.1,
                   modality="text")]
