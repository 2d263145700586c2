"""Operators an attack dispatches per iteration: on a GPU in eager mode each is at least one kernel launch, so
this count is what bounds a launch-bound loop (one target on a GPU runs no faster than its launches).

    python benchmarks/op_count.py [--iterations 5,10]

Counts torch's dispatched ATen operators (``TorchDispatchMode``, below autograd and vmap: what reaches the
kernels) for ``inverting_gradients`` solving K problems on the untrained lenet_zhu at 32x32 (K = 1) and on
ResNet-20 (K = 2), at two budgets; the difference divided by the iterations between them is the per-iteration
count (set-up and the final evaluation cancel). Prints the count, its most frequent operators, and the wall
time per iteration on this CPU.
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attack_speed import case

from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.evaluator.zoo.models import lenet_zhu, resnet20
from leakaudit.plugins.attack import Problem


#: Operators that only make a view of their input: metadata, no kernel launched on a GPU.
VIEWS = {"view", "_unsafe_view", "reshape", "slice", "select", "expand", "t", "transpose", "permute", "unsqueeze",
         "squeeze", "detach", "alias", "as_strided", "unbind", "split", "split_with_sizes", "_reshape_alias"}


class Counter(TorchDispatchMode):
    """Counts every ATen operator dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def problems(build, k: int, iterations: int) -> list[Problem]:
    """K problems (K test digits' undefended updates) on one untrained model from ``build``."""
    torch.manual_seed(0)
    model = build()
    attack = InvertingGradients(iterations=iterations)
    return [Problem(*case("cpu", i, model)[:2], torch.Generator().manual_seed(i), attack) for i in range(k)]


def count(make, k: int, iterations: int) -> tuple[collections.Counter, float]:
    """The operators dispatched by one ``reconstruct_all`` over K problems, and its wall seconds."""
    batch = problems(make, k, iterations)
    with Counter() as counter:
        start = time.perf_counter()
        InvertingGradients.reconstruct_all(batch)
        seconds = time.perf_counter() - start
    return counter.ops, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", default="5,10", help="two budgets: their difference makes the count")
    low, high = (int(x) for x in parser.parse_args().iterations.split(","))
    torch.set_num_threads(1)
    cases = {"inverting_gradients, lenet_zhu 32 px, K = 1": (lambda: lenet_zhu(1, 10, 32), 1),
             "inverting_gradients, resnet20 32 px, K = 2": (lambda: resnet20(1, 10, 32), 2)}
    for name, (make, k) in cases.items():
        count(make, k, low)  # warm-up: first calls allocate and build vmap's plans
        (few, t_few), (many, t_many) = count(make, k, low), count(make, k, high)
        per = {op: (many[op] - few[op]) / (high - low) for op in many}
        total = sum(per.values())
        kernels = sum(n for op, n in per.items() if op not in VIEWS)
        top = ", ".join(f"{op} {n:g}" for op, n in sorted(per.items(), key=lambda x: -x[1])[:12] if n)
        print(f"{name}: {total:g} operators per iteration, {kernels:g} of them computing (not views), "
              f"{1000 * (t_many - t_few) / (high - low):.1f} ms per iteration on one CPU thread; most: {top}")


if __name__ == "__main__":
    main()
