"""Audit a PyTorch Lightning training as it runs: the LeakAuditCallback in Trainer.fit (leakaudit[lightning]).
Each audited step's verdict is logged, and its scalars reach the Trainer's TensorBoard logger
(``tensorboard --logdir runs/tensorboard``).

    python examples/own_training/lightning_training.py
"""
from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from leakaudit import LeakMonitor
from leakaudit.lightning import LeakAuditCallback

from digits_client import build_model, load_data


class DigitsClassifier(pl.LightningModule):
    """The digits CNN as a LightningModule; ``forward`` maps images to logits, as the attacks call it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main(out: str = "runs/lightning_training", steps: int = 201, every: int = 50,
         board: str = "runs/tensorboard") -> dict:
    data = load_data()
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    loader = DataLoader(TensorDataset((data.train_x - mean) / std, data.train_y), batch_size=1, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    monitor = LeakMonitor(attacks=[{"name": "inverting_gradients", "params": {"iterations": 300}}], every=every,
                          out=out, mean=data.mean, std=data.std)
    trainer = pl.Trainer(max_steps=steps, callbacks=[LeakAuditCallback(monitor)], accelerator="auto",
                         logger=TensorBoardLogger(board, name="lightning_training"),  # gets each audited step's scalars
                         enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(DigitsClassifier(), loader)   # the callback writes the report when training ends
    print(f"report: {out}/report.html")
    return monitor.report()


if __name__ == "__main__":
    main()
