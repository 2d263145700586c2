"""The span test on LoRA adapters' input (adapter_span: Petrov et al. 2024's check, as Chen et al. 2026 read adapter
updates), and the rule that a defense changing what is shared is calibrated only by an attack that reads it."""
from __future__ import annotations

import pytest
import torch

from leakaudit.attacks.text import AdapterSpan, span_distance
from leakaudit.defenses.noise import NoDefense
from leakaudit.defenses.text import Lora, draw_adapters
from leakaudit.evaluator.zoo.text import TinyTransformer, classification_loss, load_pii_sentences, rouge, text_assignment
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import FEDSGD
from leakaudit.plugins.text import adapter_names

LENGTH = 16


@pytest.fixture(scope="module")
def data():
    return load_pii_sentences(length=LENGTH)


def _lora_update(data, rank: int, batch: int, trained: bool = False):
    """A LoRA model of the text tests (width 128, 3 layers), its client's exact update of ``batch`` sentences and
    the threat; ``trained``: the adapters' B drawn away from zero, as after training steps."""
    torch.manual_seed(0)
    model = Lora(rank=rank).wrap_model(TinyTransformer(data.vocab_size, data.num_classes, LENGTH, layers=3))
    if trained:
        draw_adapters(model)
    x, y = data.test_x[:batch], data.test_y[:batch]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(classification_loss(model(x), y), [p for _, p in named])
    update = SharedUpdate(list(grads), [n for n, _ in named], batch)
    threat = ThreatModel(model, classification_loss, (LENGTH,), torch.zeros(1), torch.ones(1), data.num_classes,
                         batch, NoDefense(), labels=y)
    return model, x, update, threat


@pytest.mark.parametrize("trained", [False, True])
def test_adapter_span_reads_a_lora_update_whose_rank_holds_the_batch(data, trained):
    """Rank 40, two sentences (22 tokens): at the adapters' start (B = 0) from dL/dB through A; after training
    also from dL/dA, whose rows span the first layer's inputs exactly, in the full width. Both sentences whole."""
    model, x, update, threat = _lora_update(data, 40, 2, trained)
    attack = AdapterSpan()
    assert attack.unsupported(model, 2, FEDSGD) is None
    rec = attack(update, threat, torch.Generator())
    assert rouge(rec.images[text_assignment(rec.images, x)], x, "rouge2").tolist() == [1.0, 1.0]
    span = attack._span(update, model, 0)
    assert len(span.tests) == (2 if trained else 1) and rec.extras["adapter_rank"] == 40
    if trained:  # dL/dA = s B^T delta X^T: its row space is the real tokens' first-layer inputs, no more
        inputs = model.layer_inputs(x, 0)[x != data.pad_id]
        basis = span.tests[1][0]
        assert len(basis) == len(inputs) and span_distance(inputs, basis).max() < 1e-4


def test_adapter_span_refuses_a_rank_too_small_for_the_batch_and_reads_nothing_there(data):
    """Rank 8 under a sentence of up to 16 positions: refused in one line before any work; run anyway, it reads
    nothing (the embedding is frozen: no token set either), as the rank condition says. A model without a position
    embedding to bound its tokens by is refused too."""
    model, x, update, threat = _lora_update(data, 8, 1)
    attack = AdapterSpan()
    assert attack.unsupported(model, 1, FEDSGD) == (
        "adapter_span: a span of the adapters' rank 8 holds at most 4 tokens, and an update of 1 sequences of up to "
        "16 positions may hold 16: the rank condition cannot be met (Petrov et al. 2024)")
    rec = attack(update, threat, torch.Generator())
    assert rec.extras["note"].startswith("rank condition not met") and (rec.images == data.pad_id).all()
    assert adapter_names(model.attention_name(0))[1] in update.names

    class Rotary(TinyTransformer):  # positions with no embedding to count them by
        def position_name(self) -> str:
            return "rope"

    assert attack.unsupported(Rotary(data.vocab_size, 2, LENGTH, layers=3), 1, FEDSGD) == (
        "adapter_span bounds an update's tokens by the position embedding's rows: the model has no parameter 'rope'")


LORA_AUDIT = {
    "name": "lora", "seed": 0, "device": "cpu", "workers": 1,
    "data": {"dataset": "pii_sentences", "targets": 1, "batch_size": 1,
             "params": {"length": LENGTH, "train": 200, "test": 20}},
    "model": {"name": "tiny_gpt", "params": {"width": 64, "layers": 3}, "checkpoints": [0]},
    "defenses": [{"name": "none"}, {"name": "lora", "params": {"rank": 32}, "label": "wide"},
                 {"name": "lora", "params": {"rank": 4}, "label": "narrow"}],
    "attacks": [{"name": "dager"}, {"name": "token_set"}, {"name": "adapter_span", "defenses": ["none", "wide"]}],
    "utility": {"train_steps": 2, "batch_size": 8, "lr": 0.001},
}


def test_a_lora_audit_is_judged_by_the_attack_that_reads_adapters_and_inconclusive_where_none_applies(
        write_audit, tmp_path):
    """LoRA at rank 32: adapter_span reads the sentence back, a leak. At rank 4 the only attacks run (DAGER, which
    does not declare adapter reads, and the token set) read nothing: that is no "protects" but inconclusive,
    naming the attacks that read adapters."""
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.runner import run_audit

    summary = run_audit(load_audit(write_audit(LORA_AUDIT)), tmp_path / "run", progress=False)
    worst = {w.setting: w for w in summary.worst_case}
    read = {c.attack: c.mean("rouge1") for c in summary.cells if c.setting == "wide"}
    assert worst["wide"].verdict == "leaks" and read["adapter_span"] == 1.0  # DAGER's LoRA path ties it here
    narrow = [v for v in summary.verdicts if v.setting == "narrow"][0]
    assert narrow.verdict == "inconclusive" and narrow.alone in ("protects", "protects but unusable")  # 2 steps
    assert narrow.reason.startswith("narrow shares only adapters: the low-rank adapters' gradients")
    assert "registered attacks that read it: adapter_span, lamp, tag" in narrow.reason


def test_attacks_auto_picks_adapter_span_for_lora_where_its_rank_holds_the_batch(write_audit):
    """auto chooses adapter_span for the LoRA setting whose rank holds a sentence, and says why not the other."""
    from leakaudit.evaluator.audit.auto import choose_attacks
    from leakaudit.evaluator.audit.config import load_audit

    audit = load_audit(write_audit({**LORA_AUDIT, "attacks": "auto"}))
    chosen, lines = choose_attacks(audit)
    span = next(a for a in chosen if a.name == "adapter_span")
    assert span.chosen_for is not None and {s.key for s in audit.settings if s.identity in span.chosen_for} == \
        {"none", "wide"}
    line = next(line for line in lines if line.startswith("adapter_span: chosen"))
    assert "not on narrow: adapter_span: a span of the adapters' rank 4 holds at most 0 tokens" in line


def test_a_plugin_naming_an_unknown_kind_of_update_is_refused_in_one_line():
    from leakaudit.plugins import PluginError
    from leakaudit.plugins.manager import Registry

    class Misread(AdapterSpan):
        name = "misread"
        reads = ("full", "adapter")

    with pytest.raises(PluginError, match=r"^plugin mine: attack 'misread': reads names 'adapter', not a kind of "
                                          r"update; choices: full, no embedding, adapters$"):
        Registry().add("attack", Misread, "mine")
    Registry().add("defense", Lora, "mine")  # a declared kind passes

    class Bare(AdapterSpan):  # one kind given as text, not a tuple of them: each letter would count as a kind
        name = "bare"
        reads = "adapters"  # the mistake under test

    with pytest.raises(PluginError, match=r"^plugin mine: attack 'bare': reads is 'adapters'; expected a tuple of "
                                          r"kinds of update, e.g. \('full',\); choices: full, no embedding, adapters$"):
        Registry().add("attack", Bare, "mine")

    class Unsaid(Lora):
        name = "unsaid"
        shares = None  # the mistake under test

    with pytest.raises(PluginError, match=r"^plugin mine: defense 'unsaid': shares is None, not a kind of update"):
        Registry().add("defense", Unsaid, "mine")
