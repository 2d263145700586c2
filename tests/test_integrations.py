"""LeakMonitor inside Lightning's Trainer.fit and a Flower client (the optional extras)."""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import leakaudit

sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "own_training"))
from digits_client import load_data  # noqa: E402  (the example client)

ATTACK = [{"name": "inverting_gradients", "params": {"iterations": 300}}]


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def normalised(data) -> TensorDataset:
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    return TensorDataset((data.train_x - mean) / std, data.train_y)


def test_lightning_callback_attacks_the_steps_of_trainer_fit(tmp_path):
    import lightning.pytorch as pl

    from leakaudit.evaluator.lightning import LeakAuditCallback

    from lightning_training import DigitsClassifier

    data = load_data()
    loader = DataLoader(normalised(data), batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(0))
    monitor = leakaudit.LeakMonitor(attacks=ATTACK, every=3, out=tmp_path / "run", mean=data.mean, std=data.std)
    trainer = pl.Trainer(max_steps=4, callbacks=[LeakAuditCallback(monitor)], accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(DigitsClassifier(), loader)
    found = {r["checkpoint"]: r for r in rows(tmp_path / "run")}
    assert sorted(found) == [0, 3]
    baselines = json.loads((tmp_path / "run" / "baselines.json").read_text())
    assert found[0]["psnr"] > baselines["random"]["psnr"] + 15
    assert (tmp_path / "run" / "report.html").is_file()  # written when training ended


def test_the_examples_run(tmp_path):
    import lightning_training
    import monitored_training

    plain = monitored_training.main(out=str(tmp_path / "plain"), steps=4, every=3)
    assert plain["checkpoints"] == [0, 3] and plain["worst_case"][0]["verdict"] == "leaks"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inside = lightning_training.main(out=str(tmp_path / "lightning"), steps=4, every=3)
    assert inside["checkpoints"] == [0, 3] and inside["worst_case"][0]["verdict"] == "leaks"
