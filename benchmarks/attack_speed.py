"""Attack speed: iterations per second and PSNR reached against wall time, for one fixed case.

Case: inverting_gradients on the untrained lenet_zhu (32x32 digits, batch 1, no defense).
Prints one line per checkpoint of the run, and the throughput of 1 and 2 torch threads
in one process beside 2 processes of 1 thread each (the runner's default on a 2-core CPU).

    python benchmarks/attack_speed.py [--iterations 1000] [--device cpu]
"""
from __future__ import annotations

import argparse
import multiprocessing
import time

import torch

from leakaudit.plugins.attack import ThreatModel
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.datasets import load_digits
from leakaudit.evaluator.metrics import psnr
from leakaudit.evaluator.models import lenet_zhu
from leakaudit.plugins.protocol import ClientStep
from leakaudit.evaluator.scenario import loss_fn


def case(device: str, index: int = 0):
    data = load_digits(image_size=32)
    torch.manual_seed(0)
    model = lenet_zhu(1, 10, 32).to(device)
    mean, std = data.mean.view(-1, 1, 1).to(device), data.std.view(-1, 1, 1).to(device)
    pixels, label = data.test_x[index:index + 1].to(device), data.test_y[index:index + 1].to(device)
    step = ClientStep(model, loss_fn, (pixels - mean) / std, label, torch.Generator(device=device))
    threat = ThreatModel(model, loss_fn, (1, 32, 32), mean, std, 10, 1, NoDefense(), device=torch.device(device))
    return NoDefense().share(step), threat, pixels


def psnr_against_time(iterations: int, device: str) -> None:
    observed, threat, pixels = case(device)
    print(f"PSNR against wall time ({device}, {torch.get_num_threads()} thread(s)):")
    done, start = 0, time.perf_counter()
    for budget in (iterations // 8, iterations // 4, iterations // 2, iterations):
        attack = InvertingGradients(iterations=budget)
        rec = attack(observed, threat, torch.Generator(device=device).manual_seed(0))
        done += budget
        print(f"  {budget:6d} iterations  {rec.seconds:7.2f} s  {budget / rec.seconds:7.1f} it/s  "
              f"PSNR {psnr(rec.images, pixels).item():6.2f} dB")
    print(f"  total {done} iterations in {time.perf_counter() - start:.1f} s")


def _rate(args) -> float:
    threads, iterations, index = args
    torch.set_num_threads(threads)
    observed, threat, _ = case("cpu", index)
    rec = InvertingGradients(iterations=iterations)(observed, threat, torch.Generator().manual_seed(0))
    return iterations / rec.seconds


def thread_layouts(iterations: int) -> None:
    print("CPU throughput, attack iterations per second in total:")
    for threads in (1, 2):
        print(f"  1 process  x {threads} thread(s): {_rate((threads, iterations, 0)):7.1f} it/s")
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        rates = pool.map(_rate, [(1, iterations, 0), (1, iterations, 1)])
    print(f"  2 processes x 1 thread   : {sum(rates):7.1f} it/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=1000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    psnr_against_time(args.iterations, args.device)
    if args.device == "cpu":
        thread_layouts(args.iterations // 4)


if __name__ == "__main__":
    main()
