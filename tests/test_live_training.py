"""Own training as people write it: Opacus's virtual steps and accountant, dropout, clients of one image,
verdicts on the log and scalars in the engineer's loggers, a held-out accuracy, the leakage metric chosen,
``report --config`` on a monitor's folder."""
from __future__ import annotations

import json
import logging
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import leakaudit
from leakaudit.evaluator.run.runner import report_folder

sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "own_training"))
from digits_client import build_model, load_data  # noqa: E402  (the example client)

LR = 0.05
QUICK = [{"name": "inverting_gradients", "params": {"iterations": 5}}]
STRONG = [{"name": "inverting_gradients", "params": {"iterations": 300}}]


@pytest.fixture(scope="module")
def digits():
    return load_data()


def _tensors(data, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    return (data.train_x[:n] - mean) / std, data.train_y[:n]


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def _loop(model, optimizer, loader, steps: int) -> None:
    step = 0
    while step < steps:
        for x, y in loader:
            if step == steps:
                return
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1


class DropoutNet(nn.Module):
    """pytorch/examples' mnist ``Net`` shape, small: dropout after the convolution and in the classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.drop1, self.drop2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(8 * 8 * 8, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop1(F.max_pool2d(F.relu(self.conv(x)), 2)).flatten(1)
        return self.fc2(self.drop2(F.relu(self.fc1(x))))


def test_watched_training_is_bit_identical_on_a_dropout_model(digits, tmp_path):
    """The attacks draw dropout masks, starts and noise; none of it comes from the training's random state."""
    x, y = _tensors(digits, 32)

    def run(watch: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = DropoutNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)  # shuffles from the global state
        if watch:
            monitor = leakaudit.LeakMonitor(defense={"name": "gaussian", "params": {"sigma": 0.01}}, attacks=QUICK,
                                            every=2, out=tmp_path / "run", mean=digits.mean, std=digits.std)
            model, optimizer, loader = monitor.attach(model, optimizer, loader)
        _loop(model, optimizer, loader, 6)
        if watch:
            assert monitor.audited_steps == [0, 2, 4]
        return [p.detach().clone() for p in model.parameters()]

    unwatched, watched = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(unwatched, watched))
    from leakaudit.evaluator.results.report import threat_model
    from leakaudit.evaluator.results.rundir import saved_audit

    assert dict(threat_model(saved_audit(tmp_path / "run")))["Dropout"].startswith(
        "the client's masks (p = 0.25, 0.5) are not known to the attacker")


def test_a_client_of_one_image_is_judged_against_the_attackers_own_data(digits, tmp_path):
    """The guess without the update never sees the attacked image. A client whose whole data is the batch leaves
    no mean image to guess with: beating noise and grey alone is not called a leak (it was, at 9.49 dB against
    9.08 on a Flower client); given the attacker's own images (prior=), the same update is judged against their
    mean, as an audit judges it, and leaks."""
    x, y = _tensors(digits, 1)

    def judged(out: str, **prior):
        model = build_model()
        monitor = leakaudit.LeakMonitor(attacks=STRONG, every=1, out=tmp_path / out, mean=digits.mean,
                                        std=digits.std, known_labels=True, **prior)
        model, optimizer, loader = monitor.attach(model, torch.optim.SGD(model.parameters(), lr=LR),
                                                  DataLoader(TensorDataset(x, y), batch_size=1))
        _loop(model, optimizer, loader, 1)
        return monitor.report()

    alone = judged("alone")
    assert alone.leak_threshold.missing == ("mean", "class_mean") and alone.leak_threshold.guess in ("random", "grey")
    verdict = alone.verdicts[0]
    assert verdict.verdict == "inconclusive" and verdict.alone == "leaks"
    assert ("the mean and class_mean guesses could not be made (the attacker holds no data besides the attacked "
            "batch)") in verdict.reason
    given = judged("given", prior=TensorDataset(*_tensors(digits, 65)))
    assert given.leak_threshold.guess == "class_mean" and not given.leak_threshold.missing
    assert given.label_threshold is None  # known_labels: the labels are the threat model's, no leak of the update
    assert given.leak_threshold.value < 20  # it was 201 dB when the target's own image was the "mean" guess
    assert given.verdicts[0].verdict == "leaks"


def test_verdict_lines_and_scalars_reach_the_log_and_the_loggers(digits, tmp_path, caplog):
    x, y = _tensors(digits, 8)
    board, called = [], []

    class Board:  # TensorBoard's SummaryWriter interface
        def add_scalar(self, tag, value, step):
            board.append((tag, value, step))

    model = build_model()
    monitor = leakaudit.LeakMonitor(attacks=QUICK, every=2, out=tmp_path / "run", mean=digits.mean, std=digits.std,
                                    loggers=[Board(), lambda scalars, step: called.append((step, scalars))])
    model, optimizer, loader = monitor.attach(model, torch.optim.SGD(model.parameters(), lr=LR),
                                              DataLoader(TensorDataset(x, y), batch_size=2))
    with caplog.at_level(logging.INFO, logger="leakaudit.monitor"):
        _loop(model, optimizer, loader, 3)
    lines = [r.getMessage() for r in caplog.records if r.name == "leakaudit.monitor"]
    assert any(line.startswith("LeakMonitor step 0: attacking the undefended update (2 images)") for line in lines)
    verdicts = [line for line in lines if line.startswith(("LeakMonitor step 0: ", "LeakMonitor step 2: "))
                and ("leaks:" in line or "protects:" in line or "inconclusive:" in line)]
    assert len(verdicts) == 2
    assert sorted({step for _, _, step in board}) == [0, 2]
    assert {tag for tag, _, _ in board} >= {"leakaudit/psnr", "leakaudit/leak_threshold"}
    assert [step for step, _ in called] == [0, 2] and "leakaudit/psnr" in called[0][1]


@pytest.mark.parametrize("given, line", [
    ({"loggers": [42]}, "LeakMonitor: loggers[0]: a int; expected a TensorBoard SummaryWriter (add_scalar), an object "
                        "with log_metrics(metrics, step) (Lightning's loggers, the mlflow module) or a function "
                        "(scalars, step)"),
    ({"eval_loader": 3.5}, "LeakMonitor: eval_loader: a float; expected a loader of held-out (inputs, labels) "
                           "batches"),
    ({"prior": "digits"}, "LeakMonitor: prior: a str; expected a dataset (or a loader over one) of the attacker's own "
                          "(inputs, labels) items"),
])
def test_bad_new_arguments_are_one_line_each(given, line):
    with pytest.raises(leakaudit.ConfigError) as info:
        leakaudit.LeakMonitor(attacks=QUICK, **given)
    assert info.value.lines == [line]


@pytest.mark.slow
def test_a_wrecked_model_reads_unusable_not_protects(digits, tmp_path):
    """With a held-out loader the monitor measures accuracy: a model that gets every held-out image wrong is
    unusable, whatever the attacks find."""
    x, y = _tensors(digits, 8)
    model = build_model()

    class HeldOut:  # held-out images labelled with classes the model does not predict for them
        def __iter__(self):
            with torch.no_grad():
                yield x, (model(x).argmax(dim=1) + 1) % 10

    monitor = leakaudit.LeakMonitor(defense={"name": "gaussian", "params": {"sigma": 10.0}}, attacks=STRONG, every=1,
                                    out=tmp_path / "run", mean=digits.mean, std=digits.std, eval_loader=HeldOut())
    model, optimizer, loader = monitor.attach(model, torch.optim.SGD(model.parameters(), lr=LR),
                                              DataLoader(TensorDataset(x, y), batch_size=1))
    _loop(model, optimizer, loader, 1)
    summary = monitor.report()
    mine = next(v for v in summary.verdicts if v.setting != "none")
    assert mine.accuracy == 0.0 and mine.verdict == "protects but unusable"
    assert summary.utility[mine.setting].checkpoint_accuracy == {"0": 0.0}


def test_the_leakage_metric_is_a_choice_and_report_config_rejudges_a_monitor_folder(digits, tmp_path):
    x, y = _tensors(digits, 4)
    model = build_model()
    with pytest.raises(leakaudit.ConfigError, match=r"^LeakMonitor: leakage_metric: 'sim' is not one of this "
                                                    r"audit's metrics; choices: psnr, ssim, mse, label_accuracy$"):
        leakaudit.LeakMonitor(attacks=QUICK, leakage_metric="sim", mean=0, std=1, out=tmp_path / "bad").attach(
            model, torch.optim.SGD(model.parameters(), lr=LR), DataLoader(TensorDataset(x, y)))
    monitor = leakaudit.LeakMonitor(attacks=QUICK, every=1, out=tmp_path / "run", mean=digits.mean, std=digits.std,
                                    leakage_metric="ssim")
    model, optimizer, loader = monitor.attach(model, torch.optim.SGD(model.parameters(), lr=LR),
                                              DataLoader(TensorDataset(x, y), batch_size=2))
    _loop(model, optimizer, loader, 1)
    assert monitor.report().leakage_metric == "ssim"
    judging = tmp_path / "judge.yaml"
    judging.write_text("name: rejudged\nleakage_metric: psnr\nverdict: {margin: 30.0}\n")
    summary = report_folder(tmp_path / "run", str(judging))
    assert (summary.audit, summary.leakage_metric, summary.leak_threshold.margin) == ("rejudged", "psnr", 30.0)
    judging.write_text("leakage_metric: psnr\ndata: {dataset: digits}\n")
    with pytest.raises(leakaudit.RunError, match=r"judge.yaml: data: .* was written by a LeakMonitor, judged again "
                                                  r"only by name, leakage_metric, verdict; leave data out$"):
        report_folder(tmp_path / "run", str(judging))


def test_an_old_torch_is_warned_of_once_per_process(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        leakaudit.LeakMonitor(attacks=QUICK)
        leakaudit.LeakMonitor(attacks=QUICK)  # a second client in the same process: no second warning
    found = [w for w in caught if "torch 2.8.0" in str(w.message)]
    assert len(found) == 1 and found[0].filename == "leakaudit"  # one line, no source line printed beside it
    assert re.match(r"^leakaudit: torch 2.8.0 is installed; leakaudit supports torch >= 2\.\d+", str(found[0].message))


def _private(digits, n: int, batch_size: int, accountant: str = "prv"):
    """Opacus's examples/mnist.py set-up, small: PrivacyEngine (its default accountant), SGD, Poisson batches."""
    from opacus import PrivacyEngine

    x, y = _tensors(digits, n)
    torch.manual_seed(0)
    model = build_model()
    engine = PrivacyEngine(accountant=accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size), noise_multiplier=1.0,
            max_grad_norm=1.0)
    return engine, model, optimizer, loader


def _private_steps(model, optimizer, loader, steps: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _loop(model, optimizer, loader, steps)


@pytest.mark.slow
@pytest.mark.parametrize("virtual", [False, True])
def test_opacus_is_audited_at_each_logical_step_with_the_epsilon_opacus_prints(digits, tmp_path, virtual):
    """With BatchMemoryManager the physical batches of one logical step are its batch (and the update's scale
    is the logical batch's); epsilon is the PrivacyEngine's own accountant's (PRV by default)."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    engine, model, optimizer, loader = _private(digits, 64, 16)
    monitor = leakaudit.LeakMonitor(attacks=QUICK, every=2, out=tmp_path / "run", mean=digits.mean, std=digits.std)
    model, optimizer, watched = monitor.attach(model, optimizer, loader)
    sizes = []
    if virtual:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer) as physical:
            batches = monitor.watch(physical)
            for x, y in batches:
                optimizer.zero_grad()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    F.cross_entropy(model(x), y).backward()
                    optimizer.step()
                sizes.append(len(y))
                if monitor.steps_taken == 3:
                    break
    else:
        _private_steps(model, optimizer, watched, 3)
    assert monitor.audited_steps == [0, 2] and monitor.steps_taken == 3
    rows = _rows(tmp_path / "run")
    mine = [r for r in rows if r["setting"] != "none"]
    assert [r["checkpoint"] for r in mine] == [0, 2]
    if virtual:
        assert max(sizes) <= 4 and len(mine[0]["per_image"]["psnr"]) > 4  # a logical step's physical batches
    step_two = mine[-1]["epsilon"]
    engine_epsilon = engine.get_epsilon(1e-5)  # the figure Opacus prints, after three steps
    assert engine.accountant.mechanism() == "prv"
    assert step_two == pytest.approx(engine_epsilon, rel=1e-6)


def test_opacus_batch_memory_manager_around_the_attached_loader_is_said_in_one_line(digits, tmp_path):
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    _, model, optimizer, loader = _private(digits, 64, 16)
    monitor = leakaudit.LeakMonitor(attacks=QUICK, every=1, out=tmp_path / "run", mean=digits.mean, std=digits.std)
    model, optimizer, watched = monitor.attach(model, optimizer, loader)
    with BatchMemoryManager(data_loader=watched, max_physical_batch_size=4, optimizer=optimizer) as physical:
        _private_steps(model, optimizer, physical, 8)
    skipped = json.loads((tmp_path / "run" / "monitor.json").read_text())["skipped"]
    assert skipped["0"].startswith("no batch was seen since the last step: train on the loader attach returned "
                                   "(under Opacus's BatchMemoryManager, on monitor.watch(memory_safe_loader))")
    assert monitor.audited_steps == []


@pytest.mark.slow
def test_empty_poisson_batches_are_recorded_as_skipped(digits, tmp_path):
    engine, model, optimizer, loader = _private(digits, 8, 1)  # sample rate 1/8: about a third of batches empty
    monitor = leakaudit.LeakMonitor(attacks=QUICK, every=1, out=tmp_path / "run", mean=digits.mean, std=digits.std)
    model, optimizer, watched = monitor.attach(model, optimizer, loader)
    _private_steps(model, optimizer, watched, 8)
    skipped = json.loads((tmp_path / "run" / "monitor.json").read_text())["skipped"]
    empty = [int(k) for k, why in skipped.items() if why.startswith("its Poisson-sampled batch is empty")]
    assert empty and not set(empty) & set(monitor.audited_steps)
    assert len(empty) + len(monitor.audited_steps) == 8
