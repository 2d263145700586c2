"""Watching a training never fails or changes it: code no one here wrote (a nanoGPT-layout model with fused
attention, weight tying and AdamW), an attack that raises, settings checked where the monitor is made."""
from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import leakaudit
from leakaudit.plugins.text import IGNORE
from nanogpt_layout import GPT

VOCAB, LENGTH = 64, 12


def _stream_batches(rows: int = 8) -> DataLoader:
    """nanoGPT's data: windows of a token stream, each position's target the token after it (-100 past the end)."""
    stream = torch.randint(1, VOCAB, (rows * LENGTH + 1,), generator=torch.Generator().manual_seed(3))
    x = stream[:-1].view(rows, LENGTH)
    y = stream[1:].view(rows, LENGTH).clone()
    y[:, -1] = IGNORE  # the last position of each window predicts nothing here
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _train_gpt(monitor: leakaudit.LeakMonitor | None, n_layer: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    gpt = GPT(vocab_size=VOCAB, block_size=LENGTH, n_layer=n_layer, n_embd=64)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3, weight_decay=0.1)
    loader = _stream_batches()
    if monitor is not None:
        _, optimizer, loader = monitor.attach(leakaudit.CausalLM(gpt), optimizer, loader)
    for _ in range(2):
        for x, y in loader:
            _, loss = gpt(x, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return [p.detach().clone() for p in gpt.parameters()]


def test_a_nanogpt_model_with_fused_attention_trains_unchanged_and_its_steps_are_judged(tmp_path):
    """scaled_dot_product_attention's fused kernel has no double backward (TAG died inside optimizer.step()): the
    attacks run under its math kernel, the training under the user's; the weights end bit for bit as unwatched."""
    monitor = leakaudit.LeakMonitor(attacks=["dager", {"name": "tag", "params": {"iterations": 5}}], every=2,
                                    out=tmp_path / "run")
    watched = _train_gpt(monitor)
    assert all(torch.equal(a, b) for a, b in zip(_train_gpt(None), watched))
    assert monitor.audited_steps == [0, 2]
    described = json.loads((tmp_path / "run" / "monitor.json").read_text())
    assert "failed" not in described
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert {(r["checkpoint"], r["attack"]) for r in rows} == {(s, a) for s in (0, 2) for a in ("dager", "tag")}
    summary = monitor.report()
    assert [(v.checkpoint, v.verdict is not None) for v in summary.verdicts] == [(0, True), (2, True)]


def test_an_attack_the_model_is_too_shallow_for_is_one_log_line_and_training_goes_on(tmp_path, caplog):
    """DAGER on two blocks: where the monitor is attached, one line in the user's terms, the attack recorded as
    failed, TAG attacks every audited step, and the weights end bit for bit as unwatched."""
    monitor = leakaudit.LeakMonitor(attacks=["dager", {"name": "tag", "params": {"iterations": 5}}], every=2,
                                    out=tmp_path / "run")
    with caplog.at_level("INFO", logger="leakaudit.monitor"):
        watched = _train_gpt(monitor, n_layer=2)
    assert all(torch.equal(a, b) for a, b in zip(_train_gpt(None, n_layer=2), watched))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["LeakMonitor: dager needs at least 3 transformer blocks; this model has 2; dager is not run "
                      "(recorded in monitor.json); training goes on"]
    described = json.loads((tmp_path / "run" / "monitor.json").read_text())
    assert described["failed"] == {"attach": ["dager: dager needs at least 3 transformer blocks; this model has 2"]}
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert {(r["checkpoint"], r["attack"]) for r in rows} == {(0, "tag"), (2, "tag")}


def test_a_monitor_none_of_whose_attacks_applies_is_refused_where_it_is_attached(tmp_path):
    monitor = leakaudit.LeakMonitor(attacks=["dager"], every=2, out=tmp_path / "run")
    with pytest.raises(leakaudit.ConfigError, match=r"^LeakMonitor: attacks: dager: dager needs at least 3 "
                                                    r"transformer blocks; this model has 2$"):
        _train_gpt(monitor, n_layer=2)


class Raising(leakaudit.Attack):
    """A drop-in attack that fails on every update: what a watched step must survive."""

    name = "raising"

    def reconstruct(self, observed, threat, generator):
        raise RuntimeError("derivative for aten::something is not implemented")


def test_an_attack_that_fails_is_recorded_and_the_others_run_and_training_goes_on(tmp_path, monkeypatch):
    from leakaudit.evaluator.audit.types import AttackSpec

    build = AttackSpec.build
    monkeypatch.setattr(AttackSpec, "build", lambda self, registry: Raising() if self.name == "token_set"
                        else build(self, registry))  # token_set's every run raises
    monitor = leakaudit.LeakMonitor(attacks=["token_set", "dager"], every=2, out=tmp_path / "run")
    watched = _train_gpt(monitor)
    assert all(torch.equal(a, b) for a, b in zip(_train_gpt(None), watched))
    failed = json.loads((tmp_path / "run" / "monitor.json").read_text())["failed"]
    assert sorted(failed) == ["0", "2"]
    assert failed["0"][0] == ("token_set on none: RuntimeError: derivative for aten::something is not implemented")
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert {r["attack"] for r in rows} == {"dager"}


def test_causal_lm_names_a_missing_part_in_one_line():
    with pytest.raises(TypeError, match=r"^CausalLM: head: the model has no submodule 'head' \(its children: "
                                        r"transformer, lm_head\); name it with head=$"):
        leakaudit.CausalLM(GPT(), head="head")


@pytest.mark.parametrize("kwargs, expected", [
    ({"attacks": [{"name": "inverting_gradent"}]},
     "LeakMonitor: attacks[0].name: 'inverting_gradent' is not a registered attack (did you mean "
     "'inverting_gradients'?)"),
    ({"attacks": [{"name": "inverting_gradients", "params": {"iterations": 0}}]},
     "LeakMonitor: attacks[0].params.iterations: 0"),
    ({"defense": {"name": "gaussian", "params": {"sigma": -1}}}, "LeakMonitor: defense.params.sigma: -1"),
    ({"attacks": "inverting_gradients"}, "LeakMonitor: attacks: 'inverting_gradients'; expected auto or a list"),
])
def test_a_monitor_checks_names_and_parameters_where_it_is_made(kwargs, expected):
    with pytest.raises(leakaudit.ConfigError) as err:
        leakaudit.LeakMonitor(**kwargs)
    assert str(err.value).startswith(expected)


def test_a_flower_mod_with_a_misspelt_attack_fails_when_built(tmp_path):
    pytest.importorskip("flwr")
    from leakaudit.flower import LeakAuditMod

    with pytest.raises(leakaudit.ConfigError, match=r"^LeakMonitor: attacks\[0\]\.name: 'inverting_gradent' is not "
                                                    r"a registered attack \(did you mean 'inverting_gradients'\?\)"):
        LeakAuditMod(torch.nn.Linear, attacks=[{"name": "inverting_gradent"}], out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_causal_lm_computes_the_models_own_logits_and_reads_its_layers():
    torch.manual_seed(0)
    gpt = GPT(vocab_size=VOCAB, block_size=LENGTH, n_layer=3, n_embd=64)
    model = leakaudit.CausalLM(gpt)
    x, _ = next(iter(_stream_batches()))
    torch.testing.assert_close(model(x), gpt(x)[0].transpose(1, 2), rtol=0, atol=1e-5)
    assert isinstance(model, leakaudit.TokenModel) and (model.width, model.vocab_size, model.depth) == (64, VOCAB, 3)
    assert model.attention_name(1) == "model.transformer.h.1.attn.c_attn.weight"
    names = dict(model.named_parameters())
    assert model.embedding_name() in names and model.position_name() in names
    torch.testing.assert_close(model.layer_inputs(x, 0), gpt.transformer.h[0].ln_1(
        gpt.transformer.wte(x) + gpt.transformer.wpe(torch.arange(LENGTH))))


def test_a_monitor_given_the_attackers_data_runs_auto_learning_to_invert_included(tmp_path, monkeypatch):
    """No attacks named: the audit file's automatic choice on the live model (budgets cut here to keep the test
    short), Learning to Invert trained on the attacker's own images (prior=), judged against their mean image."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "own_training"))
    from digits_client import build_model, load_data

    from leakaudit.attacks.bayes import BayesOptimal
    from leakaudit.attacks.cinet import CINet
    from leakaudit.attacks.gradient_matching import InvertingGradients
    from leakaudit.attacks.learned import LearningToInvert

    for cls in (BayesOptimal, CINet, InvertingGradients):
        monkeypatch.setattr(cls, "auto_params", {"cpu": {"iterations": 3}})
    monkeypatch.setattr(LearningToInvert, "auto_params", {"cpu": {"updates": 32, "iterations": 5, "width": 16}})
    data = load_data()
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    own = TensorDataset((data.train_x[:16] - mean) / std, data.train_y[:16])
    prior = TensorDataset((data.train_x[16:200] - mean) / std, data.train_y[16:200])
    model = build_model()
    monitor = leakaudit.LeakMonitor(every=1, out=tmp_path / "run", mean=data.mean, std=data.std, prior=prior)
    model, optimizer, loader = monitor.attach(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                              DataLoader(own, batch_size=16))
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    described = json.loads((tmp_path / "run" / "monitor.json").read_text())
    chosen = [a["name"] for a in described["attacks"]]
    assert {"inverting_gradients", "learning_to_invert"} <= set(chosen) and "dager" not in chosen
    assert "failed" not in described  # learning_to_invert had the attacker's images to learn from
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["attack"] for r in rows) == sorted(chosen)
    summary = monitor.report()
    from leakaudit.evaluator.zoo.metrics import psnr

    prior_mean = (prior.tensors[0] * std + mean).clamp(0, 1).mean(0)  # the audit's guess: their mean image
    pixels = (own.tensors[0] * std + mean).clamp(0, 1)
    assert summary.leak_threshold.guess == "class_mean" and summary.label_threshold.guess == "mean"
    assert summary.label_threshold.guess_score == pytest.approx(float(psnr(prior_mean.expand_as(pixels), pixels).mean()),
                                                               abs=1e-3)
