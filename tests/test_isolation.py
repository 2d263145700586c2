"""Regression tests: what one call or one audit must not leak into the next, and outputs that must not go missing."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms import Normalize

from leakaudit.attacks.bayes import BayesOptimal
from leakaudit.attacks.bayesian import BayesianExact, BayesianNoiseKL
from leakaudit.attacks.gradient_matching import DeepLeakage, ImprovedDeepLeakage, InvertingGradients
from leakaudit.attacks.precode import PrecodeSample
from leakaudit.attacks.vectorised import like_problems
from leakaudit.defenses.bayesian import Bayesian
from leakaudit.defenses.noise import NoDefense
from leakaudit.defenses.precode import Precode
from leakaudit.defenses.soteria import Soteria
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.jobs import jobs_of
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.live.api import audit_batch
from leakaudit.evaluator.run import executors
from leakaudit.evaluator.run.executors import PROCESS_WORTH, auto_workers, threads_per_item
from leakaudit.evaluator.run.runner import run_audit
from leakaudit.evaluator.run.scenario import loss_fn
from leakaudit.evaluator.zoo.datasets import load_digits
from leakaudit.evaluator.zoo.models import lenet_zhu, mlp
from leakaudit.plugins.attack import Problem, ThreatModel
from leakaudit.plugins.protocol import ClientStep
from leakaudit.plugins.stochastic import noise_from

from conftest import small_audit


def _digit(index: int = 0):
    data = load_digits(16)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    return (data.test_x[index:index + 1] - mean) / std, data.test_y[index:index + 1], data


@pytest.mark.parametrize("defense", ["precode", "bayesian"])
def test_audit_batch_leaves_the_callers_model_untouched(defense):
    model = lenet_zhu(1, 10, 16)
    before = [(n, type(m)) for n, m in model.named_modules()]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    x, y, data = _digit()
    with pytest.raises(ConfigError, match=f"audit_batch: defense: {defense}.*changes the architecture"):
        audit_batch(model, F.cross_entropy, x, y, defense=defense, mean=data.mean, std=data.std)
    assert [(n, type(m)) for n, m in model.named_modules()] == before
    assert model.state_dict().keys() == weights.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_audit_batch_needs_the_normalisation_and_reads_a_torchvision_normalize():
    x, y, data = _digit()
    with pytest.raises(ConfigError) as info:
        audit_batch(lenet_zhu(1, 10, 16), F.cross_entropy, x, y)
    assert info.value.lines[0].startswith("audit_batch: mean, std: required")
    with pytest.raises(ConfigError, match=r"audit_batch: mean, std: inputs \* std \+ mean spans"):
        audit_batch(lenet_zhu(1, 10, 16), F.cross_entropy, x, y, mean=0.0, std=1.0)  # normalised inputs as pixels
    attack = [{"name": "inverting_gradients", "params": {"iterations": 5}}]
    model = lenet_zhu(1, 10, 16)
    given = audit_batch(model, F.cross_entropy, x, y, attacks=attack, mean=data.mean, std=data.std)
    read = audit_batch(model, F.cross_entropy, x, y, attacks=attack,
                       normalize=Normalize(data.mean.tolist(), data.std.tolist()))
    assert read[0].metrics == given[0].metrics


@pytest.mark.slow
def test_two_audits_in_one_process_each_report_their_own_epsilon(write_audit, tmp_path):
    epsilons = []
    for steps in (5, 50):
        audit = small_audit(defenses=[{"name": "dpsgd", "params": {"noise_multiplier": 1.0}}],
                            utility={"train_steps": steps, "batch_size": 8},
                            attacks=[{"name": "inverting_gradients", "params": {"iterations": 2}}])
        out = tmp_path / f"out{steps}"
        run_audit(load_audit(write_audit(audit, name=f"a{steps}.yaml")), out, progress=False)
        (utility,) = [u for line in (out / "utility.jsonl").read_text().splitlines()
                      if (u := json.loads(line))["setting"] != "none"]  # the added reference has no epsilon
        rows = [r for line in (out / "results.jsonl").read_text().splitlines() if (r := json.loads(line))["epsilon"]]
        assert all(r["epsilon"] == utility["epsilon"] for r in rows)
        epsilons.append(utility["epsilon"])
    assert epsilons[1] > epsilons[0]


@pytest.mark.slow
def test_an_audit_without_psnr_keeps_its_main_outputs(write_audit, tmp_path):
    attacks = [{"name": "inverting_gradients", "label": "ig", "params": {"iterations": 20}},
               {"name": "inverting_gradients", "label": "ig_drop", "params": {"iterations": 20, "drop_defended": True}}]
    audit = load_audit(write_audit(small_audit(metrics=["ssim", "mse"], attacks=attacks)))
    assert audit.leakage_metric == "ssim"
    summary = run_audit(audit, tmp_path / "out", progress=False)
    assert {w.setting for w in summary.worst_case} == {"none", "gaussian(sigma=0.1)"}
    assert all(w.mean("ssim") is not None for w in summary.worst_case)
    assert len(summary.naive_vs_adaptive) == 2 and summary.naive_vs_adaptive[0].metric == "ssim"
    assert (tmp_path / "out" / "privacy_utility.png").exists()
    assert "No utility was measured" not in (tmp_path / "out" / "report.html").read_text()


def test_a_model_without_convolutions_runs_to_its_report(write_audit, tmp_path):
    audit = small_audit(model={"name": "mlp", "params": {"width": 32, "depth": 1}, "checkpoints": [0]},
                        architecture=True)
    summary = run_audit(load_audit(write_audit(audit)), tmp_path / "out", progress=False)
    (analysis,) = summary.architecture
    assert "no convolutional layer" in analysis["not_applicable"]
    assert "not computed: " in (tmp_path / "out" / "report.html").read_text()


def test_the_architecture_analysis_runs_only_where_the_audit_shows_it(write_audit, tmp_path):
    """Inverting Gradients alone: no rank computation and no section in the report (``architecture: auto``)."""
    summary = run_audit(load_audit(write_audit(small_audit())), tmp_path / "out", progress=False)
    assert summary.architecture == []
    assert "Architecture:" not in (tmp_path / "out" / "report.html").read_text()


def _problem(model, defense, batch: int = 1):
    data = load_digits(16)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    x, y = (data.test_x[:batch] - mean) / std, data.test_y[:batch]
    observed = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(0)))
    threat = ThreatModel(model, loss_fn, (1, 16, 16), mean, std, 10, batch, defense, labels=y)
    return observed, threat


@pytest.mark.parametrize("make", [
    lambda: (InvertingGradients(iterations=3, drop_defended=True), Soteria(fraction=0.5), lenet_zhu(1, 10, 16)),
    lambda: (BayesianNoiseKL(iterations=3), Bayesian(), lenet_zhu(1, 10, 16)),
])
def test_attacks_keep_no_state_between_calls(make):
    attack, defense, model = make()
    model = defense.wrap_model(model)
    settings = dict(vars(attack))
    first = attack(*_problem(model, defense), torch.Generator().manual_seed(1))
    assert vars(attack) == settings
    attack(*_problem(model, defense, batch=2), torch.Generator().manual_seed(2))
    again = attack(*_problem(model, defense), torch.Generator().manual_seed(1))
    assert torch.equal(first.images, again.images)


def test_default_workers_need_no_cpu_affinity_call(write_audit, monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS and Windows have none
    audit = small_audit(attacks=[{"name": "inverting_gradients", "params": {"iterations": PROCESS_WORTH}}],
                        defenses=[{"name": "none"}, {"name": "gaussian", "params": {"sigma": 0.1}}])
    del audit["workers"]
    loaded = load_audit(write_audit(audit))
    assert loaded.workers is None  # auto
    assert auto_workers(loaded, jobs_of(loaded)) == min(2, os.cpu_count() or 1)  # two cells: two processes at most
    assert auto_workers(loaded, jobs_of(loaded)[:1]) == 1  # one cell: its targets stay together


def test_a_stage_that_leaves_workers_idle_gives_their_cores_to_its_items(monkeypatch):
    """A lone Learning to Invert cell on two workers runs on two threads; a stage that fills them, on one each."""
    assert [threads_per_item(2, items) for items in (1, 2, 3)] == [2, 1, 1]
    assert threads_per_item(4, 2) == 2 and threads_per_item(1, 1) == 1

    class Worker:
        def attack(self, cell: str) -> int:
            return torch.get_num_threads()

    monkeypatch.setattr(executors, "_PROCESS_WORKER", Worker())
    before = torch.get_num_threads()
    try:
        assert [executors._in_process("attack", "cell", threads) for threads in (2, 1)] == [2, 1]
    finally:
        torch.set_num_threads(before)


def test_auto_workers_keep_a_small_audit_in_this_process(write_audit):
    """Starting a worker costs seconds of imports: cells of a few iterations run here, whatever the cores."""
    audit = small_audit()
    del audit["workers"]
    loaded = load_audit(write_audit(audit))
    assert auto_workers(loaded, [*loaded.settings, *jobs_of(loaded)]) == 1


@pytest.mark.slow
def test_vectorised_problems_match_one_at_a_time(write_audit, tmp_path):
    """Every target, restart and tuning trial of a cell solved together gives what max_problems: 1 gives."""
    attacks = [{"name": "inverting_gradients", "label": "ig", "params": {"iterations": 30, "restarts": 2}},
               {"name": "bayes", "params": {"iterations": 20, "radius": 0.05, "samples": 2},
                "tune": {"budget": 4, "space": {"lr": [0.03, 0.3], "signed": [False, True]}, "targets": 2}}]
    rows = {}
    for size in (1, "auto"):
        audit = small_audit(attacks=attacks, max_problems=size, utility={"train_steps": 0},
                            data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 1})
        out = tmp_path / f"out{size}"
        run_audit(load_audit(write_audit(audit, name=f"{size}.yaml")), out, progress=False)
        rows[size] = {(r["setting"], r["attack"], r["target"]): r["psnr"]
                      for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
        rows[f"tune{size}"] = sorted((t["setting"], t["trial"], t["score"])
                                     for t in map(json.loads, (out / "tuning.jsonl").read_text().splitlines()))
    assert rows[1].keys() == rows["auto"].keys() and len(rows[1]) == 16
    assert all(abs(rows[1][k] - rows["auto"][k]) < 0.1 for k in rows[1]), rows
    assert all(a[:2] == b[:2] and abs(a[2] - b[2]) < 0.1 for a, b in zip(rows["tune1"], rows["tuneauto"]))


@pytest.mark.slow
def test_vectorised_fedavg_unrolling_matches_one_at_a_time(write_audit, tmp_path):
    psnr = {}
    for size in (1, 4):
        audit = small_audit(max_problems=size, utility={"train_steps": 0}, defenses=[{"name": "none"}],
                            protocol={"name": "fedavg", "local_epochs": 2, "local_batch_size": 1, "local_lr": 0.1},
                            data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 2},
                            attacks=[{"name": "inverting_gradients", "params": {"iterations": 40}}])
        out = tmp_path / f"out{size}"
        run_audit(load_audit(write_audit(audit, name=f"{size}.yaml")), out, progress=False, workers=1)
        psnr[size] = [r["psnr"] for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())]
    assert len(psnr[1]) == 2 and all(abs(a - b) < 0.1 for a, b in zip(psnr[1], psnr[4])), psnr


def _alone_and_together(defense, model, attack, known_labels: bool = True):
    """Three problems on one model drawing its own noise: each solved alone, then all solved together."""
    problems = problems_on(defense, model, attack, known_labels)
    alone = [attack(p.observed, p.threat, torch.Generator().manual_seed(100 + k)) for k, p in enumerate(problems)]
    return alone, type(attack).reconstruct_all(problems)


def problems_on(defense, model, attack, known_labels: bool = True) -> list[Problem]:
    """Three digits' problems on one model drawing its own noise, each with its own seeded generator."""
    data = load_digits(16)
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    problems = []
    for k in range(3):
        x, y = (data.test_x[k:k + 1] - mean) / std, data.test_y[k:k + 1]
        with noise_from(model, torch.Generator().manual_seed(k)):
            observed = defense.share(ClientStep(model, loss_fn, x, y, torch.Generator().manual_seed(k)))
        threat = ThreatModel(model, loss_fn, (1, 16, 16), mean, std, 10, 1, defense, labels=y if known_labels else None)
        problems.append(Problem(observed, threat, torch.Generator().manual_seed(100 + k), attack))
    return problems


def test_bayesian_exact_solves_many_fixed_networks_together_as_one_at_a_time():
    """Each problem's network is fixed at its own draws; stacked, they give what each gives alone."""
    defense = Bayesian()
    alone, together = _alone_and_together(defense, defense.wrap_model(lenet_zhu(1, 10, 16)),
                                          BayesianExact(iterations=30))
    for a, b in zip(alone, together):
        assert torch.allclose(a.images, b.images, atol=1e-4) and b.extras["noise_identified"] == 1.0


def test_precode_sample_pins_each_problems_sample_and_solves_them_together():
    defense = Precode(size=16)
    model = defense.wrap_model(mlp(1, 10, 16, width=32, depth=1))
    alone, together = _alone_and_together(defense, model, PrecodeSample(iterations=30), known_labels=False)
    for a, b in zip(alone, together):
        assert torch.allclose(a.images, b.images, atol=1e-4) and torch.equal(a.extras["sample"], b.extras["sample"])
    assert all(m.pinned is None for m in model.modules() if hasattr(m, "pinned"))  # the audited model untouched


@pytest.mark.slow
def test_bayesian_kl_optimises_images_and_noise_of_many_problems_together():
    defense = Bayesian()
    alone, together = _alone_and_together(defense, defense.wrap_model(lenet_zhu(1, 10, 16)),
                                          BayesianNoiseKL(iterations=25, restarts=2))
    for a, b in zip(alone, together):
        assert torch.allclose(a.images, b.images, atol=1e-3)
        assert a.extras["noise"].keys() == b.extras["noise"].keys() and b.extras["noise"]
        assert all(torch.allclose(u, v, atol=1e-3) for n in a.extras["noise"]
                   for u, v in zip(a.extras["noise"][n], b.extras["noise"][n]))


@pytest.mark.slow
@pytest.mark.parametrize("attack,known", [(DeepLeakage(iterations=6, restarts=2), False),
                                          pytest.param(ImprovedDeepLeakage(iterations=6), False,
                                                       marks=pytest.mark.heavy),
                                          pytest.param(DeepLeakage(iterations=6, line_search=False), True,
                                                       marks=pytest.mark.heavy)])
def test_dlg_problems_solved_together_follow_their_own_lbfgs_path(attack, known):
    """Each problem keeps its own L-BFGS iterate and line search; evaluations and two-loop recursions are batched."""
    torch.manual_seed(0)
    alone, together = _alone_and_together(NoDefense(), lenet_zhu(1, 10, 16), attack, known_labels=known)
    for a, b in zip(alone, together):  # batched evaluations round differently: L-BFGS paths part by a few 1e-3
        gap = (a.images - b.images).abs()
        assert gap.mean() < 2e-3 and gap.max() < 5e-2 and torch.equal(a.labels, b.labels)
        assert len(a.loss_trace) == len(b.loss_trace)
        assert b.extras["match_loss"] == pytest.approx(a.extras["match_loss"], rel=0.5, abs=1e-4)


def test_lock_step_raises_a_solvers_error_and_stops_the_others():
    from leakaudit.attacks.lbfgs import LockStep

    calls = []

    def evaluate(rows, variables):
        calls.append(rows)
        return [(v[0].sum(), [2 * v[0]]) for v in variables]

    def solver(request, fail_at=None):
        x = torch.ones(2)
        for step in range(5):
            if step == fail_at:
                raise ValueError("solver 1 failed")
            x = x - 0.1 * request([x])[1][0]
        return x

    first, second = LockStep(evaluate).run([solver, lambda r: 2 * solver(r)])  # x <- 0.8 x, five times
    assert torch.allclose(first, torch.full((2,), 0.8 ** 5)) and torch.allclose(second, 2 * first)
    assert calls == [[0, 1]] * 5
    calls.clear()
    with pytest.raises(ValueError, match="solver 1 failed"):
        LockStep(evaluate).run([solver, lambda r: solver(r, fail_at=2), solver])
    assert calls == [[0, 1, 2], [0, 1, 2]]  # the others stopped at their next request


def test_auto_chunk_size_counts_without_touching_the_model():
    from torch import nn

    from leakaudit.attacks.vectorised import chunk_size, problem_footprint
    from leakaudit.defenses.noise import NoDefense

    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    threat = ThreatModel(model, F.cross_entropy, (1, 4, 4), torch.zeros(1, 1, 1), torch.ones(1, 1, 1), 2, 1, NoDefense())
    rng = torch.random.get_rng_state()
    per_problem = problem_footprint(threat, 1)
    outputs = 16 + 8 + 8 + 2 + 2  # Flatten, Linear, BatchNorm1d, Linear, and the Sequential itself
    assert per_problem == 4 * (6 * outputs + 4 * sum(p.numel() for p in model.parameters()))
    assert chunk_size(3, threat, 1, 10) == 3 and chunk_size(None, threat, 1, 10) == 10
    assert model.training and torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("value", [0, -2, "all", 1.5])
def test_max_problems_is_auto_or_a_whole_number(write_audit, value):
    with pytest.raises(ConfigError, match="max_problems: "):
        load_audit(write_audit(small_audit(max_problems=value)))


class _Shrunk(InvertingGradients):
    """Inverting Gradients whose loss also pulls the images to zero: a subclass that changes only ``objective``."""

    name = "shrunk_ig"

    def objective(self, images, labels, target, unknowns, keep, model, plain, prior):
        return super().objective(images, labels, target, unknowns, keep, model, plain, prior) + images.square().sum()


def test_an_objective_a_subclass_overrides_is_minimised_on_both_paths():
    """Solved alone (plain autograd) and together (vmapped), the subclass's own loss is the one minimised."""
    model = lenet_zhu(1, 10, 16)
    alone, together = _alone_and_together(NoDefense(), model, _Shrunk(iterations=20))
    plain = InvertingGradients.reconstruct_all(problems_on(NoDefense(), model, InvertingGradients(iterations=20)))
    for a, b, c in zip(alone, together, plain):
        assert torch.allclose(a.images, b.images, atol=1e-4)
        assert (b.images - c.images).abs().max() > 0.1  # the pull to zero moved them: the batched path ran it


@pytest.mark.parametrize("family,method", [(InvertingGradients, "reconstruct"), (InvertingGradients, "_one_run"),
                                           (DeepLeakage, "_restarts"), (BayesOptimal, "_objective")])
def test_a_subclass_that_overrides_what_only_one_problem_runs_is_refused_where_it_is_defined(family, method):
    with pytest.raises(TypeError, match=f"^Alone overrides {method} but not reconstruct_all: {family.__name__} "
                                        "solves problems together"):
        type("Alone", (family,), {method: lambda self, *args: None})
    type("Both", (family,), {method: lambda self, *args: None, "reconstruct_all": classmethod(lambda cls, p: [])})


def test_problems_whose_settings_differ_run_together_only_in_their_step_sizes_and_prior_weights():
    """The grouping key comes from the settings: a setting a subclass adds (alpha_kl) separates problems, as an
    added prior does; step sizes and prior weights do not."""
    defense = Bayesian()
    model = defense.wrap_model(lenet_zhu(1, 10, 16))
    (p, *_), vectorisable = problems_on(defense, model, BayesianNoiseKL()), BayesianNoiseKL._can_vectorise

    def key(**settings):
        return like_problems(dataclasses.replace(p, attack=BayesianNoiseKL(**settings)), vectorisable,
                             BayesianNoiseKL.per_problem)

    assert key() == key(lr=0.3, priors={"tv": 0.5})
    assert key() != key(alpha_kl=1.0) and key() != key(priors={"tv": 1e-2, "l2": 1e-3}) and key() != key(restarts=2)


def test_bayesian_kl_trials_with_their_own_kl_weight_keep_it_when_solved_together():
    defense = Bayesian()
    model = defense.wrap_model(lenet_zhu(1, 10, 16))
    problems = problems_on(defense, model, BayesianNoiseKL(iterations=10))
    for k, p in enumerate(problems):
        p.attack = BayesianNoiseKL(iterations=10, alpha_kl=[0.0, 10.0][k % 2])
    alone = [p.attack(p.observed, p.threat, torch.Generator().manual_seed(100 + k)) for k, p in enumerate(problems)]
    for a, b in zip(alone, BayesianNoiseKL.reconstruct_all(problems)):
        assert all(torch.allclose(u, v, atol=1e-4) for n in a.extras["noise"]
                   for u, v in zip(a.extras["noise"][n], b.extras["noise"][n]))
