"""Text: the offline PII sentences and their tokenizer, the zoo's small transformers, and the attacks that read a
language model's update (the token set from the embedding's gradient; DAGER, Petrov et al. 2024)."""
from __future__ import annotations

import math
import re

import pytest
import torch


from leakaudit.attacks.text import (BayesText, Bigram, Dager, Lamp, Matching, SoftTokens, Tag, TokenSet, completed,
                                   one_hot_logits, reorderings, sequence_length, span_basis, span_distance, token_set)
from leakaudit.defenses.text import FrozenEmbeddings, Lora
from leakaudit.defenses.dpsgd import DPSGD
from leakaudit.defenses.noise import NoDefense
from leakaudit.defenses.pruning import RandomPrune
from leakaudit.evaluator.zoo.text import (CORPUS, UNK, TinyTransformer, classification_loss, exact_sequence,
                                          load_pii_sentences, load_python_reference, pii_recall, rouge,
                                          text_assignment, token_accuracy, tokenize)
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import FEDSGD, ClientStep, FedAvg
from leakaudit.evaluator.zoo.metrics import label_accuracy
from leakaudit.plugins.text import (IGNORE, TokenModel, example_shares, next_token_loss, next_token_targets,
                                   predicts_next_token)

LENGTH = 16


@pytest.fixture(scope="module")
def data():
    return load_pii_sentences(length=LENGTH)


def _update(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> SharedUpdate:
    """The client's exact FedSGD update of the trainable parameters, by name."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(classification_loss(model(x), y), [p for _, p in named])
    return SharedUpdate(list(grads), [n for n, _ in named], len(x))


def _attack(data, batch: int, frozen: bool = False, causal: bool = True, **settings) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, LENGTH, width=128, causal=causal)
    model = FrozenEmbeddings().wrap_model(model) if frozen else model
    x, y = data.test_x[:batch], data.test_y[:batch]
    threat = ThreatModel(model, classification_loss, (LENGTH,), torch.zeros(1), torch.ones(1), data.num_classes,
                         batch, NoDefense(), labels=y)
    rec = Dager(**settings)(_update(model, x, y), threat, torch.Generator())
    return rec.images, rec.extras


def test_the_pii_sentences_are_seeded_tokenized_whole_and_hold_their_personal_values(data):
    again = load_pii_sentences(length=LENGTH)
    assert torch.equal(data.train_x, again.train_x) and data.test_pii == again.test_pii
    assert not torch.equal(data.train_x, load_pii_sentences(length=LENGTH, seed=1).train_x)
    assert data.vocabulary.index(UNK) not in data.test_x.tolist()  # every test word is in the vocabulary
    whole = load_pii_sentences(length=40)  # long enough that no sentence is cut
    assert (whole.test_x[:, -1] == whole.pad_id).all()
    for ids, personal in zip(whole.test_x[:50], whole.test_pii[:50]):
        text = whole.decode(ids)
        assert text == " ".join(tokenize(text)) and personal
        assert all(value in text for value in personal)
    assert sorted(set(data.train_y.tolist())) == list(range(data.num_classes))


def test_the_causal_model_reads_each_position_from_the_ones_before_and_ignores_padding(data):
    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, LENGTH).eval()
    assert isinstance(model, TokenModel)
    x = data.test_x[:4].clone()
    changed = x.clone()
    changed[:, 5] = (changed[:, 5] + 1) % data.vocab_size
    with torch.no_grad():
        a, b = model.layer_inputs(x, 2), model.layer_inputs(changed, 2)
        assert torch.allclose(a[:, :5], b[:, :5]) and not torch.allclose(a[:, 5], b[:, 5])
        first = model.blocks[0].ln_1(model.wte(x) + model.wpe.weight[:LENGTH])
        assert torch.allclose(model.layer_inputs(x, 0), first)
        real = int((x[0] != 0).sum())
        assert real < LENGTH  # the padded sentence reads as the sentence alone
        assert torch.allclose(model(x[:1]), model(x[:1, :real]), atol=1e-6)
    assert model(x).shape == (4, data.num_classes)
    encoder = TinyTransformer(data.vocab_size, data.num_classes, LENGTH, causal=False).eval()
    with torch.no_grad():  # bidirectional: an earlier position sees a later token
        assert not torch.allclose(encoder.layer_inputs(x, 1)[:, 2], encoder.layer_inputs(changed, 1)[:, 2])


def test_the_token_set_is_exact_on_an_untied_embedding_and_freezing_it_leaves_nothing_to_read(data):
    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, LENGTH)
    x, y = data.test_x[:8], data.test_y[:8]
    assert set(token_set(_update(model, x, y), model).tolist()) == set(x[x != 0].tolist())
    frozen = FrozenEmbeddings().wrap_model(model)  # Gupta et al. 2022: the embedding is not trained nor shared
    update = _update(frozen, x, y)
    assert "wte.weight" not in update.names and "wpe.weight" in update.names
    assert len(token_set(update, frozen)) == 0
    threat = ThreatModel(frozen, classification_loss, (LENGTH,), torch.zeros(1), torch.ones(1), data.num_classes, 8,
                         FrozenEmbeddings(), labels=y)
    rec = TokenSet()(update, threat, torch.Generator())
    assert (rec.images == data.pad_id).all() and "frozen" in rec.extras["note"]
    with pytest.raises(ValueError, match="not a TokenModel"):
        FrozenEmbeddings().wrap_model(torch.nn.Linear(2, 2))


def test_the_token_set_attack_reads_the_batchs_words_largest_gradient_first(data):
    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, LENGTH)
    for batch in (1, 2):
        x, y = data.test_x[:batch], data.test_y[:batch]
        threat = ThreatModel(model, classification_loss, (LENGTH,), torch.zeros(1), torch.ones(1), data.num_classes,
                             batch, NoDefense(), labels=y)
        rows = TokenSet()(_update(model, x, y), threat, torch.Generator()).images
        words, read = set(x[x != 0].tolist()), rows[0][rows[0] != 0].tolist()
        if batch == 1:  # one sentence: its words, each once, the largest gradient row first
            norms = _update(model, x, y).tensors[0].norm(dim=1)  # wte.weight's gradient
            assert set(read) == words and len(read) == len(words)
            assert all(norms[a] >= norms[b] for a, b in zip(read, read[1:]))
        else:  # two sentences hold 20 words: each row gets the 16 of largest gradient
            assert len(words) > LENGTH and len(read) == LENGTH and set(read) <= words and torch.equal(rows[0], rows[1])


@pytest.mark.parametrize("frozen", [False, True])
def test_dager_recovers_a_batch_of_eight_sequences_exactly_while_its_tokens_are_fewer_than_the_width(data, frozen):
    """Frozen embeddings (FILM) take the token set away, not the attention layers' span: DAGER still reads all."""
    rows, extras = _attack(data, 8, frozen)
    original = data.test_x[:8]
    assert int((original != 0).sum()) < 128
    assert sorted(data.decode(r) for r in rows) == sorted(data.decode(r) for r in original)
    assert "note" not in extras and max(extras["rank"]) < 128


def test_dager_says_the_rank_condition_is_not_met_and_falls_back_to_the_token_set(data):
    rows, extras = _attack(data, 16)
    original = data.test_x[:16]
    assert int((original != 0).sum()) > 128
    assert extras["note"].startswith("rank condition not met")
    assert set(rows[0][rows[0] != 0].tolist()) <= set(original[original != 0].tolist())


def test_dagers_exhaustive_search_reads_an_encoders_sentences_exactly_and_says_when_it_cannot(data):
    """A bidirectional encoder: each sentence is checked whole (its second-layer inputs all depend on every
    token). Two sentences: every combination of the positions' candidates checked, both read exactly. Four: the
    first filter passes most of the batch's tokens at every position, the combinations outnumber the cap, and
    it says so and returns the token set."""
    x = data.test_x[:2]
    rows, extras = _attack(data, 2, causal=False)
    assert torch.equal(rows[text_assignment(rows, x)], x) and "note" not in extras
    rows, extras = _attack(data, 4, causal=False, max_combinations=1_000)  # past it at length 3: 29 ** 3
    assert "the encoder search has" in extras["note"] and "the token set is returned" in extras["note"]
    words = set(data.test_x[:4].flatten().tolist()) - {data.pad_id}
    read = rows[0][rows[0] != data.pad_id].tolist()  # every row: the batch's words, unordered, as many as fit
    assert set(read) <= words and len(set(read)) == len(read) == min(LENGTH, len(words))


def test_lora_shares_only_the_adapters_and_dager_reads_them_while_the_tokens_are_fewer_than_the_rank(data):
    """Under LoRA (Hu et al. 2022) the update holds the attention adapters' and the head's gradients only. At the
    adapters' start the gradient of B is the weight's gradient through A, so DAGER's span check works in the
    rank's dimensions: exact for 4 sentences (42 tokens) at rank 64, "rank condition not met" at rank 8."""
    x, y = data.test_x[:4], data.test_y[:4]

    def attacked(rank: int):
        torch.manual_seed(0)
        model = Lora(rank=rank).wrap_model(TinyTransformer(data.vocab_size, data.num_classes, LENGTH, layers=3))
        update = _update(model, x, y)
        threat = ThreatModel(model, classification_loss, (LENGTH,), torch.zeros(1), torch.ones(1), data.num_classes,
                             4, NoDefense(), labels=y)
        return update, Dager()(update, threat, torch.Generator())

    update, rec = attacked(64)
    assert update.names == [f"blocks.{i}.qkv.parametrizations.weight.0.lora_{f}" for i in range(3) for f in "ab"] + \
        ["head.weight", "head.bias"]
    assert update.tensors[1].shape == (3 * 128, 64)
    assert rouge(rec.images[text_assignment(rec.images, x)], x, "rouge2").tolist() == [1.0] * 4
    assert rec.extras["adapter_rank"] == 64 and rec.extras["rank"][0] < 64
    _, weak = attacked(8)
    assert weak.extras["note"].startswith("rank condition not met") and "adapters' rank 8" in weak.extras["note"]
    assert (weak.images == data.pad_id).all()  # the embedding is frozen too: no token set to fall back on
    with pytest.raises(ValueError, match="lora adapts a language model's attention"):
        Lora().wrap_model(torch.nn.Linear(4, 2))


def test_the_span_distance_is_zero_inside_the_span_and_one_orthogonal_to_it():
    torch.manual_seed(0)
    inputs = torch.randn(5, 16, dtype=torch.float64)
    gradient = torch.randn(7, 5, dtype=torch.float64) @ inputs  # a sum of outer products: its rows span the inputs
    basis = span_basis(gradient, 1e-12)
    assert len(basis) == 5
    assert span_distance(inputs, basis).max() < 1e-10
    outside = torch.linalg.svd(inputs, full_matrices=True)[2][-1]  # orthogonal to every input
    assert span_distance(outside, basis).item() == pytest.approx(1.0, abs=1e-10)


def test_dager_says_which_models_it_cannot_read(data):
    attack = Dager()
    assert "not a TokenModel" in attack.unsupported(torch.nn.Linear(2, 2), 1, FEDSGD)
    encoder = TinyTransformer(data.vocab_size, data.num_classes, LENGTH, causal=False)
    assert attack.unsupported(encoder, 1, FEDSGD) is None  # the encoders' exhaustive search
    shallow = TinyTransformer(data.vocab_size, data.num_classes, LENGTH, layers=2)
    assert attack.unsupported(shallow, 1, FEDSGD) == "dager needs at least 3 transformer blocks; this model has 2"
    assert attack.unsupported(TinyTransformer(data.vocab_size, data.num_classes, LENGTH), 1, FEDSGD) is None


def test_the_text_metrics_give_their_exact_values():
    orig = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 10, 11, 0, 0, 0]])
    rec = torch.tensor([[9, 10, 12, 0, 0, 0], [5, 6, 8, 7, 0, 0]])  # out of order, as a batch comes back
    order = text_assignment(rec, orig)
    assert order.tolist() == [1, 0]
    rec = rec[order]
    assert rouge(rec, orig, "rouge1").tolist() == pytest.approx([1.0, 2 / 3], abs=1e-6)
    assert rouge(rec, orig, "rouge2").tolist() == pytest.approx([1 / 3, 1 / 2], abs=1e-6)  # bigrams 1 of 3; 1 of 2
    assert rouge(rec, orig, "rougeL").tolist() == pytest.approx([3 / 4, 2 / 3], abs=1e-6)  # common subsequences
    assert token_accuracy(rec, orig).tolist() == pytest.approx([2 / 4, 2 / 3])
    assert exact_sequence(rec, orig).tolist() == [0.0, 0.0] and exact_sequence(orig, orig).tolist() == [1.0, 1.0]
    assert pii_recall(["my card is 1 2 3", "call tom"], [["1 2 3"], ["tom", "5 5"]]) == pytest.approx(2 / 3)
    assert pii_recall(["nothing"], [[]]) is None  # no personal values: nothing to recall
    assert pii_recall(["call 5 5 5", "card 1 2"], [["5 5 5", "ann"], ["1 2 3"]]) == 1 / 3


def _sentence(data, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = next(i for i in range(len(data.test_x)) if int((data.test_x[i] != 0).sum()) == tokens)
    return data.test_x[index:index + 1], data.test_y[index:index + 1]


def _tag(data, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, **settings) -> torch.Tensor:
    threat = ThreatModel(model, classification_loss, (LENGTH,), torch.zeros(1), torch.ones(1), data.num_classes, 1,
                         NoDefense(), labels=y)
    return Tag(**settings)(_update(model, x, y), threat, torch.Generator().manual_seed(0)).images


@pytest.mark.slow
def test_tag_reads_a_sentence_back_from_a_small_models_update(data):
    x, y = _sentence(data, 14)
    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, LENGTH, layers=2)
    assert sequence_length(_update(model, x, y), model, LENGTH) == 14  # positions past the last token: no gradient
    rows = _tag(data, model, x, y, iterations=300)
    assert rouge(rows, x, "rouge1").item() >= 0.8
    assert (rows[0, 14:] == data.pad_id).all()
    shuffled = _tag(data, model, x, y, iterations=1)  # the start alone: far from the sentence
    assert rouge(shuffled, x, "rouge2").item() < 0.3


@pytest.mark.heavy
def test_tag_reaches_breachings_rouge_on_the_zoo_model(data):
    """The zoo's causal model at its default size, one 14-token sentence (the generator's longest): breaching's
    notebook reports ROUGE-1 0.80 for TAG on one 16-token sentence of its 3-layer transformer."""
    x, y = _sentence(data, 14)
    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, LENGTH)
    rows = _tag(data, model, x, y, iterations=500)
    assert rouge(rows, x, "rouge1").item() >= 0.8


def test_lamps_bigram_prior_gives_its_exact_smoothed_likelihoods():
    """Counted from [a b] and [a c] (padding after): P(a | start) = (2 + k) / (2 + 4k), P(b | a) = (1 + k) / (2 + 4k)
    with k = 0.1 over 4 ids; an unseen pair gets k / (count + 4k)."""
    prior = Bigram(torch.tensor([[1, 2, 0], [1, 3, 0]]), vocab_size=4, pad_id=0, k=0.1)
    first, second = 2.1 / 2.4, 1.1 / 2.4
    assert prior.nll(torch.tensor([[1, 2]])).item() == pytest.approx(-(math.log(first) + math.log(second)) / 2)
    unseen = -(math.log(0.1 / 2.4) + math.log(0.1 / 0.4)) / 2  # start -> b never seen; b was never followed
    assert prior.nll(torch.tensor([2, 1])).item() == pytest.approx(unseen)
    table = prior.log_table()  # the Bayes adversary's dense form, and its expectation over relaxed tokens
    assert table[0, 1].item() == pytest.approx(math.log(first)) and table[1, 3].item() == pytest.approx(math.log(second))
    one_hot = torch.nn.functional.one_hot(torch.tensor([[1, 2]]), 4).float()
    assert prior.expected_nll(one_hot, table).item() == pytest.approx(-(math.log(first) + math.log(second)), rel=1e-5)
    half = torch.tensor([[[0, 1, 0, 0], [0, 0, 0.5, 0.5]]])  # a, then b or c evenly: the same expected bigram
    assert prior.expected_nll(half, table).item() == pytest.approx(-(math.log(first) + math.log(second)), rel=1e-5)


def test_lamps_moves_are_seeded_reorderings_of_the_positions():
    moves = reorderings(9, 200, torch.Generator().manual_seed(0))
    assert torch.equal(moves.sort(1).values, torch.arange(9).expand(200, 9))  # every row a permutation
    assert torch.equal(moves, reorderings(9, 200, torch.Generator().manual_seed(0)))
    assert (moves != torch.arange(9)).any(1).all()  # every one moves something


def _lamp_case(data, y: torch.Tensor) -> tuple[torch.nn.Module, ThreatModel]:
    """A 2-layer causal model and the threat of one sentence's update, with the whole training split as the
    attacker's own sentences (LAMP's prior)."""
    from leakaudit.plugins.attack import AuxiliaryData

    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, LENGTH, layers=2)
    aux = AuxiliaryData(data.train_x, data.train_y, torch.arange(len(data.train_x)))
    return model, ThreatModel(model, classification_loss, (LENGTH,), torch.zeros(1), torch.ones(1), data.num_classes,
                              1, NoDefense(), labels=y, auxiliary=aux)


def test_lamps_discrete_step_puts_swapped_words_back_in_order(data):
    """The sentence's own embeddings with two words swapped: of the reorderings tried, the one that swaps them
    back matches the update exactly and reads most likely under the prior, so the step takes it."""
    x, y = _sentence(data, 12)
    model, threat = _lamp_case(data, y)
    generator = torch.Generator().manual_seed(0)
    match = Matching(_update(model, x, y), threat, generator, 0.01)
    swapped = x[0, :12].clone()
    swapped[[2, 8]] = swapped[[8, 2]]
    embeddings = model.wte.weight.detach()[swapped][None].clone().requires_grad_(True)
    optimiser = torch.optim.Adam([embeddings])
    prior = Bigram(data.train_x, data.vocab_size, data.pad_id)
    assert Lamp(candidates=1000)._discrete_step(embeddings, optimiser, match, prior, generator)
    assert torch.equal(match.tokens(embeddings)[0], x[0, :12])


@pytest.mark.slow
def test_lamp_reads_a_sentence_back_and_reorders_it_in_its_second_half(data):
    x, y = _sentence(data, 14)
    model, threat = _lamp_case(data, y)
    rec = Lamp(iterations=300)(_update(model, x, y), threat, torch.Generator().manual_seed(0))
    assert rouge(rec.images, x, "rouge1").item() >= 0.8
    assert 0 <= rec.extras["reorderings"] <= 300 // 2 // 25  # discrete steps in the second half only
    threat.auxiliary = None
    alone = Lamp(iterations=2, every=1)(_update(model, x, y), threat, torch.Generator().manual_seed(0))
    assert "ranked by the match alone" in alone.extras["note"]


@pytest.mark.parametrize("protocol", [FEDSGD, FedAvg(local_epochs=2, local_lr=0.1)], ids=["fedsgd", "fedavg"])
def test_one_hot_relaxed_tokens_give_the_clients_own_update(data, protocol):
    """Relaxed tokens that are one-hot are the token ids: their update, the embedding's gradient and every local
    step's re-embedding included, is the client's to float precision."""
    x, y = _sentence(data, 10)
    x = x[:, :10]  # no padding: the relaxed input has none
    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, 10, width=32, layers=2)
    threat = ThreatModel(SoftTokens(model), classification_loss, (10,), torch.zeros(1), torch.ones(1),
                         data.num_classes, 1, NoDefense(), labels=y, protocol=protocol)
    client = protocol.client_update(model, classification_loss, x, y)
    relaxed = threat.candidate_update(one_hot_logits(x, data.vocab_size).softmax(-1), y)
    assert len(relaxed) == len(client)
    for c, r in zip(client, relaxed):
        torch.testing.assert_close(r, c, atol=1e-6, rtol=1e-5)
    assert client[0].abs().sum() > 0  # the embedding's gradient, matched too


def _small_case(data, defense, protocol) -> tuple[torch.Tensor, SharedUpdate, ThreatModel]:
    """One 10-token sentence's defended update on a 2-layer causal model of width 64."""
    x, y = _sentence(data, 10)
    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, LENGTH, width=64, layers=2)
    update = defense.share(ClientStep(model, classification_loss, x, y, torch.Generator().manual_seed(1), protocol))
    return x, update, ThreatModel(model, classification_loss, (LENGTH,), torch.zeros(1), torch.ones(1),
                                  data.num_classes, 1, defense, labels=y, protocol=protocol)


@pytest.mark.slow
def test_the_bayes_adversary_reads_a_pruned_sentence_that_tag_does_not(data):
    """90% of the update's coordinates zeroed at random: TAG matches the zeros and reads at most half the words;
    the Bayes adversary, on pruning's own likelihood, reads at least 90% of them (Balunovic et al. 2022's point,
    on text; the order of a few it leaves to more iterations, docs/results.md)."""
    x, update, threat = _small_case(data, RandomPrune(fraction=0.9), FEDSGD)
    bayes = BayesText(iterations=200)(update, threat, torch.Generator().manual_seed(0))
    tag = Tag(iterations=200)(update, threat, torch.Generator().manual_seed(0))
    assert rouge(bayes.images, x, "rouge1").item() >= 0.9
    assert rouge(tag.images, x, "rouge1").item() <= 0.5


def test_the_bayes_adversary_weighs_its_bigram_prior_only_where_the_likelihood_is_a_density(data):
    """The prior joins under noise with the attacker's own sentences; not on a deterministic defense's zero-noise
    limit, nor without sentences, nor at weight 0 (the default); each run says which."""
    from leakaudit.defenses.noise import GaussianNoise
    from leakaudit.plugins.attack import AuxiliaryData

    aux = AuxiliaryData(data.train_x[:50], data.train_y[:50], torch.arange(50))
    notes = []
    for defense, auxiliary, weight in [(GaussianNoise(sigma=0.1), aux, 1.0), (NoDefense(), aux, 1.0),
                                       (GaussianNoise(sigma=0.1), None, 1.0), (GaussianNoise(sigma=0.1), aux, None)]:
        x, update, threat = _small_case(data, defense, FEDSGD)
        threat.auxiliary = auxiliary
        attack = BayesText(iterations=1) if weight is None else BayesText(iterations=1, prior_weight=weight)
        notes.append(attack(update, threat, torch.Generator()).extras["prior"])
    assert notes == ["bigram of 50 sentences, weight 1", "none: the defense is deterministic: its likelihood is a "
                     "zero-noise limit, not a density", "none: no sentences of the attacker's own "
                     "(ThreatModel.auxiliary)", "none: prior_weight is 0"]


@pytest.mark.slow
def test_tag_reads_a_fedavg_update_of_local_steps(data):
    """FedAvg, two local steps: TAG unrolls them with its embeddings held (the Bayes adversary's relaxed tokens
    give the client's own update, above)."""
    x, update, threat = _small_case(data, NoDefense(), FedAvg(local_epochs=2, local_lr=0.1))
    assert rouge(Tag(iterations=200)(update, threat, torch.Generator().manual_seed(0)).images, x, "rouge1").item() >= 0.8


TEXT_AUDIT = {
    "name": "text", "seed": 0, "device": "cpu", "workers": 1,
    "data": {"dataset": "pii_sentences", "targets": 2, "batch_size": 1,
             "params": {"length": 16, "train": 200, "test": 20}},
    "model": {"name": "tiny_gpt", "params": {"width": 64, "layers": 3}, "checkpoints": [0]},
    "defenses": [{"name": "none"}, {"name": "gaussian", "params": {"sigma": 1.0}}, {"name": "frozen_embeddings"}],
    "attacks": [{"name": "dager"}, {"name": "token_set"}],
    "utility": {"train_steps": 5, "batch_size": 8, "lr": 0.001},
}


def test_a_text_audit_reads_sentences_back_judges_them_and_shows_them(write_audit, tmp_path):
    """End to end: DAGER reads the undefended sentences back exactly (every name and number: PII recall 1),
    loud noise leaves it the guesses, frozen embeddings stop the token set but not DAGER, the verdicts say so,
    and the report shows the sentences."""
    import json

    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.runner import run_audit

    audit = load_audit(write_audit(TEXT_AUDIT))
    assert audit.metrics[0] == "rouge1" and audit.leakage_metric == "rouge1"  # text's defaults
    summary = run_audit(audit, tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    def scores(setting: str, attack: str, metric: str) -> list[float]:
        return [r[metric] for r in rows if r["setting"] == setting and r["attack"] == attack]

    assert scores("none", "dager", "rouge1") == [1.0, 1.0] and scores("none", "dager", "pii_recall") == [1.0, 1.0]
    assert min(scores("none", "token_set", "rouge1")) > 0.8  # the words, in no order
    noisy = [r for r in rows if r["setting"].startswith("gaussian")]
    assert all(r["rouge2"] < 0.5 and r["pii_recall"] < 0.5 for r in noisy)
    assert scores("frozen_embeddings", "token_set", "rouge1") == [0.0, 0.0]
    assert scores("frozen_embeddings", "dager", "rouge1") == [1.0, 1.0]
    worst = {w.setting: w for w in summary.worst_case}
    assert worst["none"].verdict == "leaks"
    assert worst["frozen_embeddings"].verdict == "leaks" and worst["frozen_embeddings"].attack == "dager"
    # personal values: the guesses score what they hold of the names and numbers, and a noisy setting whose
    # sentences hold more of them, beyond the margin, leaks them whatever its ROUGE
    guess = max(g["pii_recall"] for g in summary.baselines.values())
    assert guess < 0.5 and worst["none"].level == "individuals"
    recalled = max(c.pii_recall for c in summary.cells if c.setting == "gaussian(sigma=1.0)")
    assert (worst["gaussian(sigma=1.0)"].level == "personal values") == (recalled > guess + 0.05)
    page = (tmp_path / "run" / "report.html").read_text()
    assert "Recovered sentences" in page and "<mark>" in page and "PII recall 1.00" in page
    assert "PII recall: the share of the personal values" in page  # the legend, where the data marks them


def test_the_real_corpus_is_licensed_seeded_split_and_dager_reads_a_batch_of_it_exactly():
    """The Python documentation's sentences: the PSF licence beside them, 365 sentences of 8 pages, a seeded
    shuffle, test words outside the training vocabulary read <unk>; DAGER reads 8 of them (130 tokens) exactly at
    width 256."""
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in CORPUS.with_name("PSF-LICENSE.txt").read_text()
    assert "PSF License Agreement" in CORPUS.read_text().splitlines()[3]
    data = load_python_reference(length=24)
    assert len(data.train_x) + len(data.test_x) == 365 and data.num_classes == 8 and len(data.test_x) == 60
    assert torch.equal(data.test_x, load_python_reference(length=24).test_x)
    assert not torch.equal(data.test_x, load_python_reference(length=24, seed=1).test_x)
    assert (data.test_x == data.vocabulary.index(UNK)).any() and not (data.train_x == data.vocabulary.index(UNK)).any()
    corpus = {" ".join(tokenize(line.split("\t", 1)[1])) for line in CORPUS.read_text().splitlines()
              if line and not line.startswith("#")}
    whole = [data.decode(row) for row in data.train_x if row[-1] == data.pad_id]  # those not cut at 24 tokens
    assert len(whole) > 200 and all(sentence in corpus for sentence in whole)
    assert not data.test_pii  # no personal values marked: PII recall is not reported
    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, 24, width=256, layers=3)
    x, y = data.test_x[:8], data.test_y[:8]
    threat = ThreatModel(model, classification_loss, (24,), torch.zeros(1), torch.ones(1), data.num_classes, 8,
                         NoDefense(), labels=y)
    rows = Dager()(_update(model, x, y), threat, torch.Generator()).images
    assert torch.equal(rows[text_assignment(rows, x)], x)


@pytest.mark.slow
def test_an_audit_of_the_real_corpus_reads_it_and_reports_no_pii_recall(write_audit, tmp_path):
    """The corpus marks no personal values: its rows carry no PII recall and its report no PII legend."""
    import json

    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.runner import run_audit

    audit = {**TEXT_AUDIT, "data": {"dataset": "python_reference", "targets": 2, "batch_size": 1,
                                    "params": {"length": 24}}, "defenses": [{"name": "none"}]}
    summary = run_audit(load_audit(write_audit(audit)), tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert [r["rouge1"] for r in rows if r["attack"] == "dager"] == [1.0, 1.0]
    assert not any("pii_recall" in r for r in rows) and summary.worst_case[0].verdict == "leaks"
    assert "PII recall" not in (tmp_path / "run" / "report.html").read_text()


def test_validation_refuses_what_does_not_apply_to_the_datas_examples_in_one_line_each(write_audit):
    from leakaudit.evaluator.audit.config import ConfigError, load_audit

    wrong = {**TEXT_AUDIT, "model": {"name": "lenet_zhu"}, "attacks": [{"name": "inverting_gradients"}],
             "defenses": [{"name": "none"}, {"name": "soteria"}], "metrics": ["psnr", "rouge1"]}
    with pytest.raises(ConfigError) as err:
        load_audit(write_audit(wrong))
    lines = str(err.value).splitlines()
    assert any("model.name: lenet_zhu reads image; data.dataset pii_sentences holds text (models for text: "
               "tiny_bert, tiny_gpt, tiny_gpt_lm)" in line for line in lines)
    assert any("attacks[0]: inverting_gradients reconstructs image;" in line and "dager, lamp, tag" in line
               for line in lines)
    assert any("soteria applies to image;" in line for line in lines)
    assert any("metrics[0]: psnr scores image;" in line for line in lines)
    assert not any("rouge1" in line.split(":")[1] for line in lines if "metrics[1]" in line)
    image = {"name": "img", "data": {"dataset": "digits", "targets": 1}, "model": {"name": "lenet_zhu"},
             "defenses": [{"name": "none"}], "attacks": [{"name": "tag"}]}
    with pytest.raises(ConfigError, match=r"attacks\[0\]: tag reconstructs text; data.dataset digits holds image"):
        load_audit(write_audit(image))


def test_audit_batch_attacks_a_language_models_batch_of_token_ids(data):
    """Your own training code, text: token ids go in as they are, the text metrics score them, and what applies
    to images only is refused in one line each."""
    from leakaudit import audit_batch
    from leakaudit.evaluator.audit.types import ConfigError

    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, LENGTH, width=64, layers=3)
    x, y = data.test_x[:2], data.test_y[:2]
    results = {r.attack: r for r in audit_batch(model, classification_loss, x, y, attacks=["dager", "token_set"])}
    rows = results["dager"].reconstruction.tolist()
    assert results["dager"].metrics["rouge2"] == 1.0 and sorted(rows) == sorted(x.tolist())  # both, exactly
    assert results["token_set"].metrics["rouge2"] == 0.0 < results["token_set"].metrics["rouge1"]
    with pytest.raises(ConfigError, match=r"^audit_batch: mean, std: token ids are read as they are; leave them out$"):
        audit_batch(model, classification_loss, x, y, attacks=["dager"], mean=0.5, std=0.5)
    with pytest.raises(ConfigError) as err:
        audit_batch(model, classification_loss, x, y, attacks=["inverting_gradients"], metrics=["psnr"],
                    defense={"chain": [{"name": "clip", "params": {"max_norm": 1.0}}, {"name": "ats"}]})
    assert str(err.value).splitlines() == [
        "audit_batch: defense (clip(max_norm=1.0)>ats): ats applies to image; the inputs are text",
        "audit_batch: attacks[0]: inverting_gradients reconstructs image; the inputs are text (attacks for text: "
        "adapter_span, bayes_text, dager, lamp, tag, token_set)",
        "audit_batch: metrics[0]: psnr scores image; the inputs are text (metrics for text: exact_sequence, "
        "label_accuracy, rouge1, rouge2, rougeL, token_accuracy)"]


def _train(model, optimizer, loader, loss, steps: int) -> None:
    """A user's plain training loop: ``steps`` SGD steps of ``loss`` over the loader's batches."""
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        optimizer.zero_grad()
        loss(model(x), y).backward()
        optimizer.step()


@pytest.mark.slow
def test_the_monitor_attaches_to_a_language_models_training_loop_and_shows_its_sentences(data, tmp_path):
    """A text loop under LeakMonitor, unchanged: the first audited step's update is read back exactly by DAGER,
    judged against guesses without the update (uniform and most frequent tokens), and the report shows
    the sentences in words from the vocabulary the loop gives."""
    import json

    from torch.utils.data import DataLoader, TensorDataset

    import leakaudit

    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, LENGTH, width=64, layers=3)
    # at lr 0.1 the server's (before - after) / lr keeps the second layer's span above float32's rounding; at
    # 0.01 its smallest directions sink into it and DAGER's span check fails (docs/results.md)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(data.train_x[:64], data.train_y[:64]), batch_size=2,
                        generator=torch.Generator().manual_seed(0), shuffle=True)
    def numbers(sentence: str) -> list[str]:  # the personal values a keyboard team would mark: 6+ digit runs
        return re.findall(r"\d(?: \d){5,}", sentence)

    monitor = leakaudit.LeakMonitor(attacks=["dager", "token_set"], every=2, out=tmp_path / "run",
                                    vocabulary=data.vocabulary, personal_values=numbers)
    model, optimizer, loader = monitor.attach(model, optimizer, loader)
    _train(model, optimizer, loader, classification_loss, 3)
    summary = monitor.report()
    found = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert sorted({r["checkpoint"] for r in found}) == [0, 2]
    dager = {r["checkpoint"]: r for r in found if r["attack"] == "dager"}
    assert dager[0]["rouge2"] == 1.0 and dager[2]["rouge2"] > 0.5
    assert dager[0]["pii_recall"] == 1.0  # every number of the first audited batch, verbatim
    assert [r["pii_recall"] < 1.0 for r in found if r["attack"] == "token_set" and r["checkpoint"] == 0] == [True]
    baselines = json.loads((tmp_path / "run" / "baselines.json").read_text())
    assert set(baselines) == {"random", "frequent"} and baselines["frequent"]["rouge1"] < 0.6
    assert summary.checkpoints == [0, 2] and summary.worst_case[0].verdict == "leaks"
    page = (tmp_path / "run" / "report.html").read_text()
    assert "sentences" in page and any(data.decode(s) in page for s in data.train_x[:64])  # in words
    assert "PII recall 1.00" in page
    assert "<pad>" not in (tmp_path / "run" / "monitor.json").read_text()  # the vocabulary is kept beside it
    with pytest.raises(leakaudit.ConfigError, match="mean, std: the loader's items are token ids"):
        leakaudit.LeakMonitor(attacks=["dager"], mean=0.5, std=0.2, out=tmp_path / "other").attach(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loader)


def test_lora_lamp_bayes_text_the_corpus_and_the_monitors_vocabulary_refuse_bad_settings_in_one_line_each(
        write_audit):
    from leakaudit.evaluator.audit.config import ConfigError, load_audit

    import leakaudit

    bad = {**TEXT_AUDIT, "defenses": [{"name": "none"}, {"name": "lora", "params": {"rank": 0, "alpha": 0.0}}],
           "data": {"dataset": "python_reference", "targets": 2, "params": {"test": 365}},
           "attacks": [{"name": "lamp", "params": {"every": 0, "candidates": 0, "lm_weight": -1}},
                       {"name": "bayes_text", "params": {"prior_weight": -1, "lr": 0.0}},
                       {"name": "dager", "params": {"max_combinations": 0}}]}
    with pytest.raises(ConfigError) as err:
        load_audit(write_audit(bad))
    lines = sorted(line.split(": ", 1)[1] for line in str(err.value).splitlines())
    assert lines == ["attacks[0].params.candidates: 0 is below the minimum 1",
                     "attacks[0].params.every: 0 is below the minimum 1",
                     "attacks[0].params.lm_weight: -1 is below the minimum 0.0",
                     "attacks[1].params.lr: 0.0 must be greater than 0.0",
                     "attacks[1].params.prior_weight: -1 is below the minimum 0.0",
                     "attacks[2].params.max_combinations: 0 is below the minimum 1",
                     "data.params.test: 365 is above the maximum 364",
                     "defenses[1].params.alpha: 0.0 must be greater than 0.0",
                     "defenses[1].params.rank: 0 is below the minimum 1"]
    image = {"name": "img", "data": {"dataset": "digits", "targets": 1}, "model": {"name": "lenet_zhu"},
             "defenses": [{"name": "none"}, {"name": "lora"}], "attacks": [{"name": "inverting_gradients"}]}
    with pytest.raises(ConfigError, match=r"defenses \(lora\): lora applies to text; data.dataset digits holds image"):
        load_audit(write_audit(image))
    with pytest.raises(ConfigError, match="LeakMonitor: vocabulary: expected a list of strings, one per token id"):
        leakaudit.LeakMonitor(vocabulary="abc")
    with pytest.raises(ConfigError) as err:
        leakaudit.LeakMonitor(personal_values=["maria"])
    assert str(err.value).splitlines() == [
        "LeakMonitor: personal_values: a list; expected a function of a sentence (its tokens joined by spaces) that "
        "returns the personal values it holds",
        "LeakMonitor: personal_values: reads sentences in words; give vocabulary= too (the token of each id)"]


# A keyboard's language model: the next token at every position.

@pytest.fixture(scope="module")
def keyboard():
    return load_pii_sentences(length=LENGTH, task="next_token")


def test_a_keyboards_labels_are_each_positions_next_token_and_its_loss_counts_the_positions_that_have_one():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    targets = next_token_targets(ids, 0)
    assert targets.tolist() == [[6, 7, IGNORE, IGNORE], [9, IGNORE, IGNORE, IGNORE]]
    logits = torch.zeros(2, 10, 4)
    logits[0, 6, 0] = math.log(9.0)  # position 0 of row 0 gives its target 9 / 18 = 0.5
    expected = (math.log(2.0) + 2 * math.log(10.0)) / 3  # three positions have a target
    assert next_token_loss(logits, targets).item() == pytest.approx(expected, rel=1e-6)
    soft = torch.nn.functional.one_hot(targets.clamp_min(0), 10).float() * (targets >= 0)[..., None]
    assert next_token_loss(logits, soft.transpose(1, 2)).item() == pytest.approx(expected, rel=1e-6)
    assert label_accuracy(torch.tensor([[7, 6, IGNORE]]), targets) == pytest.approx(2 / 3)  # the words, in any order


def test_the_keyboard_data_and_model_predict_every_positions_next_token(keyboard):
    assert keyboard.task == "next_token" and keyboard.num_classes == keyboard.vocab_size
    assert torch.equal(keyboard.test_y, next_token_targets(keyboard.test_x, keyboard.pad_id))
    model = TinyTransformer(keyboard.vocab_size, keyboard.num_classes, LENGTH, width=32, layers=1, next_token=True)
    x = keyboard.test_x[:2]
    assert model(x).shape == (2, keyboard.vocab_size, LENGTH) and predicts_next_token(model)
    changed = x.clone()
    changed[:, 5] = 3  # a later token does not move an earlier position's prediction
    assert torch.allclose(model(x)[..., :5], model(changed)[..., :5])


def _keyboard_case(keyboard, batch: int, layers: int = 3, tokens: int | None = None):
    """The exact FedSGD update of ``batch`` test sentences (or one of ``tokens`` tokens) on the keyboard model."""
    torch.manual_seed(0)
    model = TinyTransformer(keyboard.vocab_size, keyboard.num_classes, LENGTH, width=128, layers=layers,
                            next_token=True)
    if tokens is None:
        x, y = keyboard.test_x[:batch], keyboard.test_y[:batch]
    else:
        x, y = _sentence(keyboard, tokens)
    update = NoDefense().share(ClientStep(model, next_token_loss, x, y, torch.Generator().manual_seed(1), FEDSGD))
    return x, update, ThreatModel(model, next_token_loss, (LENGTH,), torch.zeros(1), torch.ones(1),
                                  keyboard.num_classes, len(x), NoDefense())


def test_a_sentences_last_word_which_only_the_head_reads_comes_back_from_the_heads_gradient(keyboard):
    x, update, threat = _keyboard_case(keyboard, 4)
    assert sequence_length(update, threat.model, LENGTH) == int((x != 0).sum(1).max()) - 1  # never an input
    cut = x.clone()
    cut[torch.arange(4), (x != 0).sum(1) - 1] = 0
    assert torch.equal(completed(update, threat, cut), x)
    short = load_pii_sentences(length=12, train=10, test=8, task="next_token")  # 4 rows fill the input
    torch.manual_seed(0)
    model = TinyTransformer(short.vocab_size, short.num_classes, 12, width=64, layers=1, next_token=True)
    x, y = short.test_x, short.test_y
    update = NoDefense().share(ClientStep(model, next_token_loss, x, y, torch.Generator(), FEDSGD))
    threat = ThreatModel(model, next_token_loss, (12,), torch.zeros(1), torch.ones(1), short.num_classes, 8, NoDefense())
    full = (x != 0).all(1)
    cut = x.clone()
    cut[~full, (x[~full] != 0).sum(1) - 1] = 0
    assert 0 < int(full.sum()) < 8 and torch.equal(completed(update, threat, cut), x)


def test_dager_reads_a_keyboards_batch_of_eight_exactly(keyboard):
    x, update, threat = _keyboard_case(keyboard, 8)
    rec = Dager()(update, threat, torch.Generator())
    assert "note" not in rec.extras
    assert rouge(rec.images[text_assignment(rec.images, x)], x, "rouge2").tolist() == [1.0] * 8
    assert torch.equal(rec.labels, next_token_targets(rec.images, 0))


@pytest.mark.slow
@pytest.mark.parametrize("attack, bars", [(Tag(iterations=300), (0.8, 0.7)), (BayesText(iterations=300), (0.9, 0.8))],
                         ids=["tag", "bayes_text"])
def test_tag_and_the_bayes_adversary_read_a_keyboards_sentence_back(keyboard, attack, bars):
    """One 14-token sentence on a 2-layer keyboard model: its next tokens are the candidate's own (TAG: the
    words it reads; the Bayes adversary: its relaxed tokens), its last word the head's. TAG's bars are lower: it
    reads 12 to 13 of the 14 words, as CPU kernels differ (ROUGE-1 0.857 on one Xeon, 0.890 on another)."""
    x, update, threat = _keyboard_case(keyboard, 1, layers=2, tokens=14)
    rows = attack(update, threat, torch.Generator().manual_seed(0)).images
    assert rouge(rows, x, "rouge1").item() >= bars[0] and rouge(rows, x, "rouge2").item() >= bars[1]
    start = type(attack)(iterations=1)(update, threat, torch.Generator().manual_seed(0)).images
    assert rouge(start, x, "rouge2").item() < 0.3


def test_a_model_and_data_that_learn_different_things_are_refused_in_one_line(write_audit):
    from leakaudit.evaluator.audit.config import ConfigError, load_audit

    lm_on_classes = {**TEXT_AUDIT, "model": {"name": "tiny_gpt_lm"}}
    with pytest.raises(ConfigError, match=r"model.name: tiny_gpt_lm learns next_token; data.params.task is classify "
                                          r"\(models for classify: tiny_bert, tiny_gpt\)$"):
        load_audit(write_audit(lm_on_classes))
    classes_on_words = {**TEXT_AUDIT, "data": {**TEXT_AUDIT["data"], "params": {"task": "next_token"}}}
    with pytest.raises(ConfigError, match=r"model.name: tiny_gpt learns classify; data.params.task is next_token "
                                          r"\(models for next_token: tiny_gpt_lm\)$"):
        load_audit(write_audit(classes_on_words))
    with pytest.raises(ConfigError, match=r"audit.yaml: data.params.task: 'words' is not one of the choices; choices: "
                                          r"classify, next_token$"):
        load_audit(write_audit({**TEXT_AUDIT, "data": {**TEXT_AUDIT["data"], "params": {"task": "words"}}}))


@pytest.mark.slow
def test_a_keyboard_audit_trains_on_next_words_and_reads_its_sentences_back(write_audit, tmp_path):
    """End to end on the keyboard model: plain SGD learns the next word well above always guessing the most
    frequent one, DAGER reads the undefended sentences back whole (their last words from the head), PII recall 1;
    DP-SGD trains it through Opacus, with its epsilon."""
    import json

    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.runner import run_audit

    audit = {**TEXT_AUDIT, "data": {**TEXT_AUDIT["data"], "params": {**TEXT_AUDIT["data"]["params"],
                                                                      "task": "next_token"}},
             "model": {**TEXT_AUDIT["model"], "name": "tiny_gpt_lm"},
             "defenses": [{"name": "none"}, {"name": "dpsgd", "params": {"noise_multiplier": 1.0}}],
             "utility": {"train_steps": 40, "batch_size": 16, "lr": 0.1}}
    run_audit(load_audit(write_audit(audit)), tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    dager = [r for r in rows if r["attack"] == "dager" and r["setting"] == "none"]
    assert [(r["rouge2"], r["pii_recall"], r["label_accuracy"]) for r in dager] == [(1.0, 1.0, 1.0)] * 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    accuracy, chance = summary["utility"]["none"]["accuracy"], summary["chance_accuracy"]
    assert accuracy > 1.5 * chance and chance < 0.1, (accuracy, chance)
    private = summary["utility"]["dpsgd(noise_multiplier=1.0)"]  # trained by Opacus's PrivacyEngine
    assert 0 < private["epsilon"] < math.inf and private["accuracy"] < accuracy
    page = (tmp_path / "run" / "report.html").read_text()
    assert "the most frequent next word&#39;s share of the test split" in page
    assert "each sentence&#39;s own next words" in page


@pytest.mark.slow
def test_the_monitor_and_audit_batch_read_a_keyboards_own_training_loop(keyboard, tmp_path):
    """A keyboard's loop under LeakMonitor, trained on next_token_loss: DAGER reads the first audited step's
    sentences back whole (their last words from the head), and audit_batch reads a batch the same way."""
    import json

    from torch.utils.data import DataLoader, TensorDataset

    import leakaudit
    from leakaudit.evaluator.live.api import audit_batch

    torch.manual_seed(0)
    model = TinyTransformer(keyboard.vocab_size, keyboard.num_classes, LENGTH, width=64, layers=3, next_token=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(keyboard.train_x[:32], keyboard.train_y[:32]), batch_size=2,
                        generator=torch.Generator().manual_seed(0), shuffle=True)
    monitor = leakaudit.LeakMonitor(attacks=["dager"], every=2, out=tmp_path / "run",
                                    vocabulary=keyboard.vocabulary)
    model, optimizer, loader = monitor.attach(model, optimizer, loader)
    _train(model, optimizer, loader, next_token_loss, 1)
    monitor.report()
    found = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert [(r["checkpoint"], r["rouge2"], r["label_accuracy"]) for r in found] == [(0, 1.0, 1.0)]
    x, y = keyboard.test_x[:2], keyboard.test_y[:2]
    (result,) = audit_batch(model, next_token_loss, x, y, attacks=["dager"])
    assert result.metrics["rouge2"] == 1.0 and result.metrics["token_accuracy"] == 1.0


def test_dpsgd_shares_a_keyboards_update_as_its_likelihood_centres_it(keyboard):
    """Opacus's per-sample gradients of the mean next-token loss weigh each sentence by its positions; the
    candidate the Bayes adversary's likelihood is centred on does too, clipped or not."""
    torch.manual_seed(0)
    model = TinyTransformer(keyboard.vocab_size, keyboard.num_classes, LENGTH, width=32, layers=2, next_token=True)
    x, y = keyboard.test_x[:4], keyboard.test_y[:4]
    assert example_shares(y).tolist() == pytest.approx((4 * (y >= 0).sum(1) / (y >= 0).sum()).tolist())
    for norm in (0.5, 100.0):  # every example clipped; none
        defense = DPSGD(noise_multiplier=0.0, max_grad_norm=norm)
        sent = defense.share(ClientStep(model, next_token_loss, x, y, torch.Generator(), FEDSGD)).tensors
        threat = ThreatModel(model, next_token_loss, (LENGTH,), torch.zeros(1), torch.ones(1), keyboard.num_classes,
                             4, defense)
        centre = defense.candidate_update(threat, x, y)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(sent, centre))


@pytest.mark.slow
def test_the_bayes_adversary_reads_a_keyboards_sentence_through_dpsgds_own_likelihood(keyboard):
    x, y = _sentence(keyboard, 12)
    torch.manual_seed(0)
    model = TinyTransformer(keyboard.vocab_size, keyboard.num_classes, LENGTH, width=64, layers=2, next_token=True)
    defense = DPSGD(noise_multiplier=0.01, max_grad_norm=1.0)
    update = defense.share(ClientStep(model, next_token_loss, x, y, torch.Generator().manual_seed(1), FEDSGD))
    threat = ThreatModel(model, next_token_loss, (LENGTH,), torch.zeros(1), torch.ones(1), keyboard.num_classes, 1,
                         defense)
    rows = BayesText(iterations=200)(update, threat, torch.Generator().manual_seed(0)).images
    assert rouge(rows, x, "rouge1").item() >= 0.8


def test_the_modality_objects_answer_what_differs_between_images_and_text():
    """The step asks the modality, not "is this text": token ids are attacked as they are (the monitor reads them
    as long), with no prior-free corridor, decoy test or pixel check; images are pixels in [0, 1] from their
    normalisation, a wrong one refused in one line; each names its examples and default metrics."""
    from leakaudit.evaluator.audit.types import ConfigError
    from leakaudit.evaluator.results.verdict import prior_free_bound
    from leakaudit.evaluator.run.modality import IMAGES, TEXT, modality_of
    from leakaudit.plugins.manager import load_registry

    ids = torch.tensor([[3, 4, 0]], dtype=torch.int32)
    assert TEXT.attacked(ids, None)[0] is ids and TEXT.read(ids).dtype == torch.long
    assert TEXT.prior_free(1.0, ids, 0.95) is None and not TEXT.decoys and TEXT.unit == "sentence"
    assert TEXT.recall(lambda aligned, update: 0.5, ids, None) == 0.5
    pixels = torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    got, mean, std = IMAGES.attacked((pixels - 0.5) / 0.25, (0.5, 0.25))
    assert torch.allclose(got, pixels, atol=1e-6) and mean.shape == std.shape == (1, 1, 1)
    with pytest.raises(ConfigError, match=r"^audit_batch: mean, std: inputs \* std \+ mean spans"):
        IMAGES.attacked(pixels * 10, (0.5, 0.25))  # not normalised by these
    assert IMAGES.prior_free(1.0, pixels, 0.95) == prior_free_bound(1.0, pixels.numpy(), 0.95)
    assert IMAGES.recall(lambda aligned, update: 0.5, pixels, None) is None and IMAGES.decoys
    registry = load_registry(entry_points=False)
    assert "lpips" not in IMAGES.default_metrics(registry) and "rouge1" in TEXT.default_metrics(registry)
    assert modality_of("text") is TEXT and modality_of("image") is IMAGES
