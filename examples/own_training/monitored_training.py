"""Audit a training loop as it runs: attach a LeakMonitor once, as Opacus's make_private attaches, and train.

The client is the digits CNN of ``digits_client.py``, trained with SGD, momentum and weight decay on
pre-normalised images, one image per step (the most exposed update). Every 50 steps the monitor attacks
the update the optimizer applied, writes the rows to ``runs/monitored_training``, logs the step's verdict
and sends its scalars to TensorBoard (``tensorboard --logdir runs/tensorboard``).

    python examples/own_training/monitored_training.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter

from leakaudit import LeakMonitor

from digits_client import build_model, load_data


def main(out: str = "runs/monitored_training", steps: int = 201, every: int = 50,
         board: str = "runs/tensorboard/monitored_training") -> dict:
    data = load_data()
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    loader = DataLoader(TensorDataset((data.train_x - mean) / std, data.train_y), batch_size=1, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    writer = SummaryWriter(board)
    monitor = LeakMonitor(attacks=[{"name": "inverting_gradients", "params": {"iterations": 300}}], every=every,
                          out=out, mean=data.mean, std=data.std,   # the loader normalised with these
                          loggers=[writer])                        # each audited step's scalars
    model, optimizer, loader = monitor.attach(model, optimizer, loader)

    audits = len(range(0, steps, every))
    print(f"training {steps} steps; the monitor attacks steps 0, {every}, {2 * every}, ... ({audits} audits; "
          "its log says how long the first took, and each costs about as much)", flush=True)
    for step, (x, y) in enumerate(loader):                           # the loop, unchanged
        if step == steps:
            break
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    monitor.detach()
    writer.close()
    summary = monitor.report()
    for cell in summary.cells:
        print(f"step {cell.checkpoint}: {cell.attack} rebuilds the image at {cell.mean('psnr'):.1f} dB PSNR")
    for w in summary.worst_case:
        print(f"verdict: {w.setting} {w.verdict}: {w.reason}")
    print(f"report: {out}/report.html")
    return summary


if __name__ == "__main__":
    main()
