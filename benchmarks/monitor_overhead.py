"""What LeakMonitor costs a training loop: step time with and without it, and the time of an audited step.

Trains the example client's CNN (examples/own_training, 16x16 digits) with SGD and momentum, once plainly
and once under a monitor whose ``every`` is larger than the run (only step 0 is attacked), and prints the
median time of the steps after the first of each, and how long the audited step took. Between audited
steps the monitor's hooks only count the step and keep a reference to the batch.

    python benchmarks/monitor_overhead.py [--steps 300] [--batch-size 32] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import leakaudit

sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "own_training"))
from digits_client import build_model, load_data  # noqa: E402  (the example client)


def step_times(model, optimizer, loader, steps: int, device: torch.device) -> list[float]:
    """Seconds of each training step (forward, backward, optimizer step), synchronised on CUDA."""
    times = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        start = time.perf_counter()
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    data = load_data()
    mean, std = data.mean.view(-1, 1, 1), data.std.view(-1, 1, 1)
    dataset = TensorDataset((data.train_x - mean) / std, data.train_y)

    def setup():
        model = build_model().to(device)
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loader

    plain = step_times(*setup(), args.steps, device)
    with tempfile.TemporaryDirectory() as out:
        monitor = leakaudit.LeakMonitor(attacks=[{"name": "inverting_gradients", "params": {"iterations": 300}}],
                                        every=10 ** 9, out=out, mean=data.mean, std=data.std)
        model, optimizer, loader = setup()
        watched = step_times(*monitor.attach(model, optimizer, loader), args.steps, device)
    print(f"{args.steps} steps of batch {args.batch_size} on {device.type}, torch threads {torch.get_num_threads()}")
    print(f"  without the monitor: median step {statistics.median(plain[1:]) * 1e3:.3f} ms")
    print(f"  with the monitor (every > steps): median step {statistics.median(watched[1:]) * 1e3:.3f} ms "
          f"({statistics.median(watched[1:]) / statistics.median(plain[1:]):.2f}x)")
    print(f"  the audited step 0 (inverting_gradients, 300 iterations, batch {args.batch_size}): {watched[0]:.2f} s")


if __name__ == "__main__":
    main()
