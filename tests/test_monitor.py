"""LeakMonitor: attached once to a training loop, it attacks the update the optimizer really applied."""
from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchvision import transforms

import leakaudit
from leakaudit.evaluator.results.rundir import RunFolder, saved_audit
from leakaudit.evaluator.run.runner import rebuild_report

sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "own_training"))
from digits_client import build_model, load_data  # noqa: E402  (the example client)

ATTACK = [{"name": "inverting_gradients", "params": {"iterations": 300}}]
LR = 0.05


@pytest.fixture(scope="module")
def digits():
    return load_data()


def normalised_loader(data, batch_size: int = 1) -> DataLoader:
    """Digits normalised ahead of time: nothing in the loader says how."""
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    dataset = TensorDataset((data.train_x - mean) / std, data.train_y)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))


class Transformed(Dataset):
    """Raw digits through a torchvision transform, as a torchvision dataset holds them."""

    def __init__(self, x, y, transform):
        self.x, self.y, self.transform = x, y, transform

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.transform(self.x[i]), self.y[i]


def train(model, optimizer, loader, steps: int, changes: dict | None = None, audited=(),
          grads: dict | None = None) -> None:
    """The user's loop, unchanged; records (theta_before - theta_after) / lr at the ``audited`` steps in
    ``changes``, and the gradient the optimizer stepped with in ``grads``."""
    for step, (x, y) in enumerate(loader):
        if step == steps:
            return
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if changes is not None and step in audited:
            changes[step] = [(b - p.detach()) / LR for b, p in zip(before, model.parameters())]
        if grads is not None and step in audited:
            grads[step] = [p.grad.detach().clone() for p in model.parameters()]


def rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("memory", [True, False])
def test_attacks_the_step_momentum_and_weight_decay_hide_and_leaks(digits, tmp_path, memory):
    """The server that kept every update undoes momentum and weight decay and attacks the step's own gradient;
    with ``attacker: {memory: false}`` the update the step applied is attacked as it is."""
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)
    monitor = leakaudit.LeakMonitor(attacks=ATTACK, every=3, out=tmp_path / "run", mean=digits.mean, std=digits.std,
                                    attacker={"memory": memory})
    model, optimizer, loader = monitor.attach(model, optimizer, normalised_loader(digits))
    changes: dict = {}
    grads: dict = {}
    train(model, optimizer, loader, 4, changes, audited=(3,), grads=grads)
    # the last audited step (3) is one with momentum and weight decay
    for attacked, expected in zip(monitor.last_update, (grads if memory else changes)[3]):
        torch.testing.assert_close(attacked, expected, rtol=1e-4, atol=1e-6)
    found = {r["checkpoint"]: r for r in rows(tmp_path / "run")}
    assert sorted(found) == [0, 3]
    baselines = json.loads((tmp_path / "run" / "baselines.json").read_text())
    assert found[0]["psnr"] > baselines["random"]["psnr"] + 15  # the first step's update is a plain gradient
    # the class-aware guess from the attacker's data less the batch: each target's class mean beats the mean image
    assert baselines["class_mean"]["psnr"] > baselines["mean"]["psnr"]
    assert found[0]["label_accuracy"] == 1.0
    summary = monitor.report()
    assert summary.checkpoints == [0, 3] and summary.worst_case[0].verdict == "leaks"
    assert (tmp_path / "run" / "report.html").is_file() and (tmp_path / "run" / "leakage_by_step.png").is_file()


@pytest.mark.slow
def test_the_model_and_its_training_are_left_as_they_would_be(digits, tmp_path):
    plain_model, watched = build_model(), build_model()
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=LR, momentum=0.9)
    train(plain_model, plain_opt, normalised_loader(digits), 4)
    monitor = leakaudit.LeakMonitor(attacks=ATTACK, every=2, out=tmp_path / "run", mean=digits.mean, std=digits.std)
    model, optimizer, loader = monitor.attach(watched, torch.optim.SGD(watched.parameters(), lr=LR, momentum=0.9),
                                              normalised_loader(digits))
    train(model, optimizer, loader, 4)
    for a, b in zip(plain_model.parameters(), watched.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    monitor.detach()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_no_normalisation_where_the_loader_normalises_is_refused(digits, tmp_path):
    model = build_model()
    monitor = leakaudit.LeakMonitor(attacks=ATTACK, out=tmp_path / "run")
    with pytest.raises(leakaudit.ConfigError) as err:
        monitor.attach(model, torch.optim.SGD(model.parameters(), lr=LR), normalised_loader(digits))
    assert str(err.value) == ("LeakMonitor: mean, std: the loader applies no torchvision Normalize to read them from, "
                              "and leakaudit will not guess; pass mean= and std= (mean=0, std=1 for raw pixels in "
                              "[0, 1])")
    assert not (tmp_path / "run").exists()  # refused before any work


def test_personal_values_on_an_image_loop_is_refused_before_any_work(digits, tmp_path):
    model = build_model()
    monitor = leakaudit.LeakMonitor(attacks=ATTACK, out=tmp_path / "run", mean=digits.mean, std=digits.std,
                                    vocabulary=["a"], personal_values=lambda sentence: [])
    with pytest.raises(leakaudit.ConfigError) as err:
        monitor.attach(model, torch.optim.SGD(model.parameters(), lr=LR), normalised_loader(digits))
    assert str(err.value) == ("LeakMonitor: personal_values: the loader's items are images; PII recall reads a "
                              "language model's sentences: leave it out")
    assert not (tmp_path / "run").exists()


def test_reads_the_loaders_torchvision_normalize_and_refuses_a_wrong_one(digits, tmp_path):
    normalize = transforms.Normalize(digits.mean.tolist(), digits.std.tolist())
    dataset = Transformed(digits.train_x, digits.train_y, transforms.Compose([normalize]))
    loader = DataLoader(dataset, batch_size=1)
    model = build_model()
    monitor = leakaudit.LeakMonitor(attacks=ATTACK, every=10, out=tmp_path / "run")
    monitor.attach(model, torch.optim.SGD(model.parameters(), lr=LR), loader)
    assert monitor._stats == (tuple(normalize.mean), tuple(normalize.std))
    wrong = leakaudit.LeakMonitor(attacks=ATTACK, out=tmp_path / "other", mean=0.5, std=0.5)
    with pytest.raises(leakaudit.ConfigError, match=r"^LeakMonitor: mean, std: 0.5, 0.5 differ from the loader's "
                                                    r"Normalize"):
        wrong.attach(model, torch.optim.SGD(model.parameters(), lr=LR), loader)


@pytest.mark.parametrize("kwargs, expected", [
    ({"every": 0}, "LeakMonitor: every: 0; expected a whole number >= 1"),
    ({"attacks": ["inverting_gradient"]}, "LeakMonitor: attacks[0].name: 'inverting_gradient' is not a registered "
                                          "attack (did you mean 'inverting_gradients'?); choices:"),
    ({"defense": "gausian"}, "LeakMonitor: defense.name: 'gausian' is not a registered defense (did you mean "
                             "'gaussian'?); choices:"),
    ({"delta": 2.0}, "LeakMonitor: delta: 2.0; expected a number in (0, 1)"),
    ({"attacker": {"memry": False}}, "LeakMonitor: attacker.memry: unknown key; choices: memory"),
    ({"attacker": {"memory": "yes"}}, "LeakMonitor: attacker.memory: 'yes' is not of type bool; choices: true, false"),
    ({"attacker": "memory"}, "LeakMonitor: attacker: 'memory'; expected a mapping such as {'memory': False}"),
    ({"attacks": [{"name": "bayes", "checkpoints": [0]}]},
     "LeakMonitor: attacks[0].checkpoints: LeakMonitor attacks every 100-th step; leave checkpoints out"),
])
def test_bad_settings_are_one_line_errors_before_any_work(digits, tmp_path, kwargs, expected):
    model = build_model()
    with pytest.raises(leakaudit.ConfigError) as err:
        monitor = leakaudit.LeakMonitor(**{"attacks": ATTACK, "mean": digits.mean, "std": digits.std,
                                           "out": tmp_path / "run", **kwargs})
        monitor.attach(model, torch.optim.SGD(model.parameters(), lr=LR), normalised_loader(digits))
    assert str(err.value).splitlines()[0].startswith(expected)
    assert not (tmp_path / "run").exists()


def test_a_loader_of_non_images_is_refused(tmp_path):
    model = torch.nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.rand(8, 4), torch.zeros(8, dtype=torch.long)), batch_size=2)
    with pytest.raises(leakaudit.ConfigError) as err:
        leakaudit.LeakMonitor(attacks=ATTACK, mean=0, std=1, out=tmp_path / "run").attach(
            model, torch.optim.SGD(model.parameters(), lr=LR), loader)
    assert str(err.value).splitlines()[0] == ("LeakMonitor: loader: its items hold inputs of shape (4,); the attacks "
                                              "rebuild images (C, H, W)")


def test_a_defense_is_applied_to_the_update_and_attacked_with_its_likelihood(digits, tmp_path):
    model = build_model()
    monitor = leakaudit.LeakMonitor(defense={"name": "gaussian", "params": {"sigma": 1.0}},
                                    attacks=[{"name": "bayes", "params": {"iterations": 100}}], every=5,
                                    out=tmp_path / "run", mean=digits.mean, std=digits.std)
    model, optimizer, loader = monitor.attach(model, torch.optim.SGD(model.parameters(), lr=LR),
                                              normalised_loader(digits))
    train(model, optimizer, loader, 1)
    row, reference = rows(tmp_path / "run")
    assert row["setting"] == "gaussian(sigma=1.0)" and row["attack"] == "bayes"
    assert row["psnr"] < 14  # noise a thousand times the gradient's scale hides the image
    assert reference["setting"] == "none" and reference["psnr"] > row["psnr"] + 10  # the step calibrated


@pytest.mark.slow
def test_a_second_attach_to_the_folder_resumes_and_report_rebuilds_it(digits, tmp_path):
    for _ in range(2):
        model = build_model()
        monitor = leakaudit.LeakMonitor(attacks=ATTACK, every=2, out=tmp_path / "run", mean=digits.mean,
                                        std=digits.std)
        model, optimizer, loader = monitor.attach(model, torch.optim.SGD(model.parameters(), lr=LR),
                                                  normalised_loader(digits))
        train(model, optimizer, loader, 3)
    assert [r["checkpoint"] for r in rows(tmp_path / "run")] == [0, 2]  # the second run added nothing
    summary = rebuild_report(RunFolder(tmp_path / "run", saved_audit(tmp_path / "run")))
    assert summary.checkpoints == [0, 2]
    other = leakaudit.LeakMonitor(attacks=ATTACK, every=3, out=tmp_path / "run", mean=digits.mean, std=digits.std)
    with pytest.raises(leakaudit.ConfigError, match="holds a monitor run with other settings"):
        other.attach(model, torch.optim.SGD(model.parameters(), lr=LR), normalised_loader(digits))
    with pytest.raises(leakaudit.RunError, match="^LeakMonitor: no step attacked yet in "):
        leakaudit.LeakMonitor(attacks=ATTACK).report()


@pytest.mark.slow
def test_under_opacus_the_noised_dp_update_is_attacked_and_epsilon_reported(digits, tmp_path):
    from opacus import PrivacyEngine

    engine = PrivacyEngine(accountant="rdp")
    model = build_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5),
            data_loader=normalised_loader(digits, batch_size=4), noise_multiplier=0.5, max_grad_norm=1.0,
            noise_generator=torch.Generator().manual_seed(0))
    monitor = leakaudit.LeakMonitor(attacks=[*ATTACK, {"name": "bayes", "params": {"iterations": 100}}], every=3,
                                    out=tmp_path / "run", mean=digits.mean, std=digits.std)
    model, optimizer, loader = monitor.attach(model, optimizer, loader)
    grads: dict = {}
    train(model, optimizer, loader, 4, audited=(3,), grads=grads)
    for attacked, noisy in zip(monitor.last_update, grads[3]):  # the noisy gradient, its momentum undone
        torch.testing.assert_close(attacked, noisy, rtol=1e-4, atol=1e-6)
    found = [r for r in rows(tmp_path / "run") if r["setting"] != "none"]  # "none": the clean gradient, calibrating
    assert {r["setting"] for r in rows(tmp_path / "run")} == {"dpsgd(max_grad_norm=1.0,noise_multiplier=0.5)", "none"}
    last = [r for r in found if r["checkpoint"] == 3]
    assert last and all(r["epsilon"] == pytest.approx(engine.get_epsilon(1e-5), rel=1e-9) for r in last)
    assert [r["checkpoint"] for r in found if r["attack"] == "bayes"] == sorted({r["checkpoint"] for r in found})


def _sigmoid_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.Sigmoid(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 16 * 16, 10))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_the_server_that_kept_every_update_undoes_the_optimizer(digits, tmp_path, optimizer):
    """SGD with momentum 0.9 and Adam, one digit per step, steps 0, 10 and 20 audited: the attacker with memory
    scores within 1 dB of attacking the step's own gradient at the same weights (SGD: equal, up to rounding),
    where the update alone scores far under it."""
    make = {"sgd_momentum": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, weight_decay=1e-4),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-3)}[optimizer]
    x, y = (digits.train_x[:32] - digits.mean.view(-1, 1, 1)) / digits.std.view(-1, 1, 1), digits.train_y[:32]
    scores, direct = {}, {}
    for memory in (True, False):
        model = _sigmoid_net()
        loader = DataLoader(TensorDataset(x, y), batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(0))
        monitor = leakaudit.LeakMonitor(attacks=ATTACK, every=10, out=tmp_path / str(memory), mean=digits.mean,
                                        std=digits.std, metrics=["psnr"], attacker={"memory": memory})
        model, opt, loader = monitor.attach(model, make(model.parameters()), loader)
        for step, (inputs, labels) in enumerate(loader):
            if step == 21:
                break
            if memory and step in (10, 20):  # the step's own gradient, attacked at the same weights and seed
                (result,) = leakaudit.audit_batch(copy.deepcopy(model), F.cross_entropy, inputs, labels,
                                                  mean=digits.mean, std=digits.std, attacks=ATTACK,
                                                  metrics=["psnr"], step=step)
                direct[step] = result.metrics["psnr"]
            opt.zero_grad()
            F.cross_entropy(model(inputs), labels).backward()
            opt.step()
        monitor.detach()
        scores[memory] = {r["checkpoint"]: r["psnr"] for r in rows(tmp_path / str(memory))}
    for step in (10, 20):
        assert abs(scores[True][step] - direct[step]) < 1.0, (step, scores, direct)
        assert scores[False][step] < scores[True][step] - 8.0  # momentum (or Adam's moments) blur the update alone
    summary = json.loads((tmp_path / "True" / "monitor.json").read_text())
    assert summary["undone"].startswith("the server undoes ")


def test_an_optimizer_the_server_cannot_undo_is_attacked_on_its_raw_update_and_says_so(digits, tmp_path):
    model = build_model()
    monitor = leakaudit.LeakMonitor(attacks=[{"name": "inverting_gradients", "params": {"iterations": 5}}], every=5,
                                    out=tmp_path / "run", mean=digits.mean, std=digits.std)
    with pytest.warns(UserWarning, match="LeakMonitor: attacker memory: RMSprop's update is not undone"):
        model, optimizer, loader = monitor.attach(model, torch.optim.RMSprop(model.parameters(), lr=1e-3),
                                                  normalised_loader(digits))
    changes: dict = {}
    train(model, optimizer, loader, 1, changes, audited=(0,))
    for attacked, changed in zip(monitor.last_update, changes[0]):  # (before - after) / LR: rescaled to RMSprop's lr
        torch.testing.assert_close(attacked, changed * LR / 1e-3, rtol=1e-4, atol=1e-6)
    assert "the server attacks the raw update" in (tmp_path / "run" / "monitor.json").read_text()
