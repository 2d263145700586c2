"""Does batching DLG's L-BFGS across problems pay? The measurement behind ``DeepLeakage.reconstruct_all``.

L-BFGS with a strong-Wolfe line search (``dlg``'s default, as torch.optim.LBFGS runs it) spends a
different number of loss evaluations on each problem at each step: the line search stops when its
conditions hold, and a problem's inner loop stops when its loss or step stalls. Run in lock step,
K problems would each pay, at every step, for the evaluations of the slowest of them. This script
measures, for K ``dlg`` problems on the untrained lenet_zhu (32x32 digits, batch 1):

- the per-problem wall time and loss evaluations (each one update and its gradient, as the attack runs);
- the lock-step evaluations: per outer step, the most any problem needed, summed;
- the time of one vmapped evaluation of all K problems (torch.func: functional_call, grad, vmap);

from them an upper bound on the speed-up of any batched L-BFGS with a line search per problem
(lock-step evaluations x batched evaluation time, no line-search or history bookkeeping counted);
and the speed-ups measured for ``DeepLeakage.reconstruct_all`` (``BatchedLBFGS``: evaluations and
two-loop recursions batched) and for the lock-step reference (``LockStep``: torch.optim.LBFGS per
problem, one thread each, only the evaluations batched).

    python benchmarks/lbfgs_batching.py [--k 16] [--iterations 20] [--device cpu]
"""
from __future__ import annotations

import argparse
import time

import torch

from leakaudit.attacks import gradient_matching
from leakaudit.attacks.gradient_matching import DeepLeakage
from leakaudit.attacks.vectorised import SharedModel, candidate_update
from leakaudit.plugins.attack import Problem
from leakaudit.plugins.defense import squared_distance
from leakaudit.plugins.protocol import FEDSGD

from attack_speed import case


def per_problem(k: int, iterations: int, device: str) -> tuple[float, list[list[int]]]:
    """Wall time of ``dlg`` on each of K problems, and each problem's loss evaluations per outer step."""
    counts: list[int] = []
    original_distance, original_step = gradient_matching.squared_distance, torch.optim.LBFGS.step

    def counted_distance(*args):
        counts[-1] += 1
        return original_distance(*args)

    def counted_step(self, closure):
        counts.append(0)
        return original_step(self, closure)

    gradient_matching.squared_distance, torch.optim.LBFGS.step = counted_distance, counted_step
    per_step: list[list[int]] = []
    seconds = 0.0
    try:
        model = torch.nn.Module()
        for i in range(k):
            observed, threat, _ = case(device, i, model if i else None)
            model = threat.model
            counts.clear()
            rec = DeepLeakage(iterations=iterations, restarts=1)(observed, threat,
                                                                   torch.Generator(device=device).manual_seed(i))
            seconds += rec.seconds
            per_step.append(list(counts))
    finally:
        gradient_matching.squared_distance, torch.optim.LBFGS.step = original_distance, original_step
    return seconds, per_step


def batched_evaluation(k: int, device: str, repeats: int = 20) -> float:
    """Seconds for one vmapped loss-and-gradient evaluation of K problems (images and soft labels)."""
    observed, threat, _ = case(device, 0)
    shared = SharedModel.of(threat.model)
    threat.protocol = FEDSGD
    target = [torch.stack([t] * k) for t in observed.tensors]

    def loss(images, logits, tgt):
        return squared_distance(tgt, candidate_update(shared, threat, images, torch.softmax(logits, -1)))

    step = torch.func.vmap(torch.func.grad_and_value(loss, argnums=(0, 1)))
    images = torch.randn((k, 1, 1, 32, 32), device=device)
    logits = torch.randn((k, 1, 10), device=device)
    step(images, logits, target)  # build vmap's plan
    start = time.perf_counter()
    for _ in range(repeats):
        step(images, logits, target)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def solved_together(k: int, iterations: int, device: str, lock_step: bool = False) -> float:
    """Wall time of ``DeepLeakage.reconstruct_all`` on the same K problems (with ``lock_step``, of ``LockStep``)."""
    problems, model = [], None
    for i in range(k):
        observed, threat, _ = case(device, i, model)
        model = threat.model
        problems.append(Problem(observed, threat, torch.Generator(device=device).manual_seed(i),
                                DeepLeakage(iterations=iterations, restarts=1)))
    start = time.perf_counter()
    if lock_step:
        batch, solve = DeepLeakage._batch(problems, lock_step=True)
        solve(batch)
    else:
        DeepLeakage.reconstruct_all(problems, max_problems=k)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--iterations", type=int, default=20, help="L-BFGS outer steps (each up to 20 inner iterations)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    seconds, per_step = per_problem(args.k, args.iterations, args.device)
    evaluations = sum(map(sum, per_step))
    steps = max(map(len, per_step))
    lock_step = sum(max((c[t] if t < len(c) else 0) for c in per_step) for t in range(steps))
    batch = batched_evaluation(args.k, args.device)
    print(f"dlg on lenet_zhu, K = {args.k}, {args.iterations} outer steps, {args.device}, {args.threads} thread(s)")
    print(f"  per problem: {seconds:.2f} s in all, {evaluations} loss evaluations "
          f"({seconds / evaluations * 1e3:.2f} ms each, L-BFGS bookkeeping included)")
    spread = [sum(c) for c in per_step]
    print(f"  evaluations per problem: min {min(spread)}, mean {evaluations / args.k:.0f}, max {max(spread)}")
    print(f"  lock step: {lock_step} evaluations of all K ({lock_step * args.k / evaluations:.1f}x the work)")
    print(f"  one vmapped evaluation of K: {batch * 1e3:.2f} ms ({batch / args.k * 1e3:.2f} ms per problem)")
    bound = lock_step * batch
    print(f"  batched L-BFGS, at best: {bound:.2f} s, {seconds / bound:.2f}x per-problem speed")
    for name, lock_step in (("reconstruct_all (BatchedLBFGS)", False), ("lock step (LockStep)", True)):
        together = solved_together(args.k, args.iterations, args.device, lock_step)
        print(f"  measured, {name}: {together:.2f} s, {seconds / together:.2f}x per-problem speed")


if __name__ == "__main__":
    main()
