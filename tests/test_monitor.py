"""LeakMonitor: attached once to a training loop, it attacks the update the optimizer really applied."""
from __future__ import annotations

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
from leakaudit.evaluator.rundir import RunFolder, saved_audit
from leakaudit.evaluator.runner import rebuild_report

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


def train(model, optimizer, loader, steps: int, changes: dict | None = None, audited=()) -> None:
    """The user's loop, unchanged; records (theta_before - theta_after) / lr at the ``audited`` steps."""
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


def rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_attacks_the_update_momentum_and_weight_decay_make_and_leaks(digits, tmp_path):
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)
    monitor = leakaudit.LeakMonitor(attacks=ATTACK, every=3, out=tmp_path / "run", mean=digits.mean, std=digits.std)
    model, optimizer, loader = monitor.attach(model, optimizer, normalised_loader(digits))
    changes: dict = {}
    train(model, optimizer, loader, 4, changes, audited=(3,))
    # the last audited step (3) is one with momentum and weight decay: the attacked update is what the step applied
    for attacked, changed in zip(monitor.last_update, changes[3]):
        torch.testing.assert_close(attacked, changed, rtol=1e-5, atol=1e-6)
    found = {r["checkpoint"]: r for r in rows(tmp_path / "run")}
    assert sorted(found) == [0, 3]
    baselines = json.loads((tmp_path / "run" / "baselines.json").read_text())
    assert found[0]["psnr"] > baselines["random"]["psnr"] + 15  # the first step's update is a plain gradient
    assert found[0]["label_accuracy"] == 1.0
    summary = monitor.report()
    assert summary["checkpoints"] == [0, 3] and summary["worst_case"][0]["verdict"] == "leaks"
    assert (tmp_path / "run" / "report.html").is_file() and (tmp_path / "run" / "leakage_by_step.png").is_file()


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
    (row,) = rows(tmp_path / "run")
    assert row["setting"] == "gaussian(sigma=1.0)" and row["attack"] == "bayes"
    assert row["psnr"] < 14  # noise a thousand times the gradient's scale hides the image


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
    assert summary["checkpoints"] == [0, 2]
    other = leakaudit.LeakMonitor(attacks=ATTACK, every=3, out=tmp_path / "run", mean=digits.mean, std=digits.std)
    with pytest.raises(leakaudit.ConfigError, match="holds a monitor run with other settings"):
        other.attach(model, torch.optim.SGD(model.parameters(), lr=LR), normalised_loader(digits))
    with pytest.raises(leakaudit.RunError, match="^LeakMonitor: no step attacked yet in "):
        leakaudit.LeakMonitor(attacks=ATTACK).report()


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
    changes: dict = {}
    train(model, optimizer, loader, 4, changes, audited=(3,))
    for attacked, changed in zip(monitor.last_update, changes[3]):
        torch.testing.assert_close(attacked, changed, rtol=1e-5, atol=1e-6)
    found = rows(tmp_path / "run")
    assert {r["setting"] for r in found} == {"dpsgd(max_grad_norm=1.0,noise_multiplier=0.5)"}
    last = [r for r in found if r["checkpoint"] == 3]
    assert last and all(r["epsilon"] == pytest.approx(engine.get_epsilon(1e-5), rel=1e-9) for r in last)
    assert [r["checkpoint"] for r in found if r["attack"] == "bayes"] == sorted({r["checkpoint"] for r in found})
