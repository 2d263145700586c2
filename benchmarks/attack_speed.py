"""Attack speed: image-iterations per second against the number of problems solved together, vectorised
beside one at a time; PSNR reached against wall time; thread layouts; the quickstart's wall time.

Case: inverting_gradients on the untrained lenet_zhu (32x32 digits, batch 1, no defense); K problems
are K different target images, each with its own start. "one at a time" runs ``attack(...)`` per
problem (the path a plugin attack written for one problem takes); "vectorised" runs
``InvertingGradients.reconstruct_all`` on all K (torch.func: functional_call, grad, vmap); with
``--compile``, also through torch.compile (an audit's ``compile: true``: on CUDA, whole iterations captured as CUDA
graphs and replayed, K = 1 included), its first compilation timed apart.

    python benchmarks/attack_speed.py [--iterations 200] [--device cpu] [--ks 1,8,64] [--compile] [--quickstart]
"""
from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.attacks.vectorised import compile_steps
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.run.scenario import loss_fn
from leakaudit.evaluator.zoo.datasets import load_digits
from leakaudit.evaluator.zoo.metrics import psnr
from leakaudit.evaluator.zoo.models import lenet_zhu
from leakaudit.plugins.attack import Problem, ThreatModel
from leakaudit.plugins.protocol import ClientStep


def case(device: str, index: int = 0, model: torch.nn.Module | None = None):
    """One target image's undefended update on the untrained lenet_zhu (``model``: share one across problems)."""
    data = load_digits(image_size=32)
    torch.manual_seed(0)
    model = model if model is not None else lenet_zhu(1, 10, 32).to(device)
    mean, std = data.mean.view(-1, 1, 1).to(device), data.std.view(-1, 1, 1).to(device)
    pixels, label = data.test_x[index:index + 1].to(device), data.test_y[index:index + 1].to(device)
    step = ClientStep(model, loss_fn, (pixels - mean) / std, label, torch.Generator(device=device))
    threat = ThreatModel(model, loss_fn, (1, 32, 32), mean, std, 10, 1, NoDefense(), device=torch.device(device))
    return NoDefense().share(step), threat, pixels


def problems(device: str, k: int, iterations: int) -> list[Problem]:
    attack = InvertingGradients(iterations=iterations)
    torch.manual_seed(0)
    model = lenet_zhu(1, 10, 32).to(device)  # one model for all problems, as in one cell of an audit
    out = []
    for i in range(k):
        observed, threat, _ = case(device, i % 300, model)
        out.append(Problem(observed, threat, torch.Generator(device=device).manual_seed(i), attack))
    return out


def _vectorised_rate(device: str, k: int, iterations: int) -> tuple[float, float]:
    """Image-iterations per second of ``reconstruct_all`` on K problems, after a warm-up of 5 iterations (first
    calls allocate, build vmap's plans and compile): the rate, and the warm-up's seconds."""
    warm = problems(device, k, 5)
    start = time.perf_counter()
    InvertingGradients.reconstruct_all(warm, max_problems=k)
    _sync(device)
    warm_up = time.perf_counter() - start
    fresh = problems(device, k, iterations)  # built before the clock starts: loading data is not attacking
    start = time.perf_counter()
    InvertingGradients.reconstruct_all(fresh, max_problems=k)
    _sync(device)
    return k * iterations / (time.perf_counter() - start), warm_up


def vectorised_against_one_at_a_time(device: str, ks: list[int], iterations: int, compiled: bool) -> None:
    print(f"image-iterations per second against K ({device}, {torch.get_num_threads()} thread(s), "
          f"{iterations} iterations):")
    print(f"  {'K':>6}  {'one at a time':>14}  {'vectorised':>12}  {'speed-up':>8}"
          + (f"  {'compiled':>10}  {'speed-up':>8}  {'first compile':>13}" if compiled else ""))
    for k in ks:
        batch = problems(device, k, iterations)
        batch[0].attack(batch[0].observed, batch[0].threat, batch[0].generator)  # warm-up
        one = min(k, 8)  # one at a time is linear in K: time a few and scale
        start = time.perf_counter()
        for p in batch[:one]:
            p.attack(p.observed, p.threat, p.generator)
        _sync(device)
        serial = one * iterations / (time.perf_counter() - start)
        vector, _ = _vectorised_rate(device, k, iterations)
        line = f"  {k:6d}  {serial:14.0f}  {vector:12.0f}  {vector / serial:7.1f}x"
        if compiled:
            restore = compile_steps(True, cuda_graphs=device == "cuda")  # as an audit that compiles on CUDA
            try:
                fast, warm_up = _vectorised_rate(device, k, iterations)
            finally:
                restore()
            line += f"  {fast:10.0f}  {fast / serial:7.1f}x  {warm_up:11.1f} s"
        print(line, flush=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def quickstart_wall_time(device: str) -> None:
    """The quickstart audit from the command line, on ``device``."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "configs" / "quickstart.yaml").read_text().replace("device: auto", f"device: {device}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "quickstart.yaml"
        path.write_text(text)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "leakaudit", "run", str(path), "--out", str(Path(tmp) / "out"),
                        "--no-progress"], check=True, capture_output=True)
        print(f"quickstart on {device}: {time.perf_counter() - start:.1f} s wall time (imports included)")


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
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ks", default="1,8,64", help="numbers of problems solved together, comma-separated")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--compile", action="store_true", help="also the vectorised steps through torch.compile")
    p.add_argument("--quickstart", action="store_true", help="also time the quickstart audit")
    p.add_argument("--layouts", action="store_true", help="also PSNR against time and the CPU thread layouts")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    vectorised_against_one_at_a_time(args.device, [int(k) for k in args.ks.split(",")], args.iterations, args.compile)
    if args.layouts:
        psnr_against_time(args.iterations * 5, args.device)
        if args.device == "cpu":
            thread_layouts(args.iterations)
    if args.quickstart:
        quickstart_wall_time(args.device)


if __name__ == "__main__":
    main()
