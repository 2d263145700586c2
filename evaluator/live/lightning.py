"""LeakMonitor inside PyTorch Lightning's ``Trainer.fit``: a callback (install ``leakaudit[lightning]``).

The callback binds the monitor to the LightningModule, its optimizer and its training set when training
starts, hands it each batch, sends each audited step's scalars to the Trainer's loggers (TensorBoard, CSV,
MLflow, ...) beside the monitor's own, and writes the report when training ends. The module's ``forward`` must map
images to logits: the attacks call it.
"""
from __future__ import annotations

from typing import Any

from leakaudit.evaluator.live.monitor import LeakMonitor

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("leakaudit's Lightning callback needs Lightning: pip install 'leakaudit[lightning]'") from exc


class LeakAuditCallback(Callback):
    """Attack the update of every ``monitor.every``-th optimizer step of ``Trainer.fit`` (its first optimizer)."""

    def __init__(self, monitor: LeakMonitor) -> None:
        self.monitor = monitor

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loader = trainer.train_dataloader
        self.monitor.bind(pl_module, trainer.optimizers[0], getattr(loader, "dataset", None), loader)
        self.monitor.loggers += [lg for lg in trainer.loggers if lg not in self.monitor.loggers]  # the Trainer's

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.monitor.observe_batch(batch)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.monitor.detach()
        if self.monitor.audited_steps:
            self.monitor.report()
