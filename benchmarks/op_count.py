"""Operators an attack dispatches per iteration: on a GPU in eager mode each is at least one kernel launch, so
this count is what bounds a launch-bound loop (one target on a GPU runs no faster than its launches).

    python benchmarks/op_count.py [--iterations 5,10] [--compile]

Counts torch's dispatched ATen operators (``TorchDispatchMode``, below autograd and vmap: what reaches the
kernels) for ``inverting_gradients`` solving K problems on the untrained lenet_zhu at 32x32 (K = 1) and on
ResNet-20 (K = 2), and for ``bayesian_kl`` on VB-ResNet-18 (every layer Bayesian, K = 1), at two budgets; the
difference divided by the iterations between them is the per-iteration count (set-up and the final evaluation
cancel). Prints the count, its most frequent operators, and the wall time per iteration on this CPU.

``--compile`` counts what an audit with ``compile: true`` runs instead: the kernels of the compiled iteration
(inductor's fused kernels and the library calls it keeps, such as convolutions), read from the code inductor
generates for the vectorised path at the same K, on this CPU. On CUDA inductor generates Triton kernels of about
the same number, each a launch without CUDA graphs; with them (an audit's default there), one graph replay.
A compiler failure is raised here, not run eagerly as in an audit.
"""
from __future__ import annotations

import argparse
import collections
import re
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attack_speed import case
from attack_times import case as bayesian_case

from leakaudit.attacks.bayesian import BayesianNoiseKL
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.attacks.vectorised import compile_steps, run_chunks
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


def bayesian_problems(k: int, iterations: int) -> list[Problem]:
    """One CIFAR-10 image's update through VB-ResNet-18, attacked by ``bayesian_kl`` (Chen et al. 2024)."""
    observed, threat = bayesian_case("resnet18", 64, "cpu")
    attack = BayesianNoiseKL(iterations=iterations)
    return [Problem(observed, threat, torch.Generator().manual_seed(i), attack) for i in range(k)]


def count(make: Callable[[int], list[Problem]], iterations: int) -> tuple[collections.Counter, float]:
    """The operators dispatched by one ``reconstruct_all`` of ``make(iterations)``'s problems, and its wall seconds."""
    batch = make(iterations)
    attack = type(batch[0].attack)
    with Counter() as counter:
        start = time.perf_counter()
        attack.reconstruct_all(batch)
        seconds = time.perf_counter() - start
    return counter.ops, seconds


#: A kernel call in inductor's generated ``call``: its own fused kernels (C++ or Triton) and the library calls it keeps.
KERNEL_CALL = re.compile(r"^\s+(?:\w+ = )?((?:cpp_fused|triton)_\w+|extern_kernels\.\w+|torch\.ops\.aten\.\w+)[.(]", re.M)


def compiled_kernels(make: Callable[[int], list[Problem]]) -> collections.Counter:
    """The kernels one compiled iteration runs: the vectorised path compiled on ``make(2)``'s problems (one chunk),
    counted in the ``call`` function of each module inductor generated for it."""
    from torch._inductor.codecache import PyCodeCache

    batch = make(2)
    before = set(map(id, PyCodeCache.modules))
    restore = compile_steps(True)
    import torch._dynamo.config as dynamo_config

    dynamo_config.suppress_errors = False  # a step that fails to compile is an error here, not 0 kernels
    try:
        run_chunks(batch, type(batch[0].attack)._batch, len(batch))
    finally:
        restore()
    kernels: collections.Counter = collections.Counter()
    sources = {Path(m.__file__).read_text() for m in PyCodeCache.modules if id(m) not in before}
    for source in sources:  # a recompilation to the same code loads the same module twice
        if "def call(" in source:
            body = source[source.index("def call("):]
            kernels.update("fused" if k.startswith(("cpp_fused", "triton")) else k.rsplit(".", 1)[-1]
                           for k in KERNEL_CALL.findall(body.split("\ndef ", 1)[0]))
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", default="5,10", help="two budgets: their difference makes the count")
    parser.add_argument("--compile", action="store_true", help="count the compiled iteration's kernels instead")
    args = parser.parse_args()
    low, high = (int(x) for x in args.iterations.split(","))
    torch.set_num_threads(1)
    cases: dict[str, Callable[[int], list[Problem]]] = {
        "inverting_gradients, lenet_zhu 32 px, K = 1": lambda n: problems(lambda: lenet_zhu(1, 10, 32), 1, n),
        "inverting_gradients, resnet20 32 px, K = 2": lambda n: problems(lambda: resnet20(1, 10, 32), 2, n),
        "bayesian_kl, VB-ResNet-18 32 px, K = 1": lambda n: bayesian_problems(1, n)}
    for name, make in cases.items():
        if args.compile:
            kernels = compiled_kernels(make)
            print(f"{name}, compiled: {sum(kernels.values())} kernels per iteration "
                  f"({', '.join(f'{k} {n}' for k, n in kernels.most_common())})")
            continue
        count(make, low)  # warm-up: first calls allocate and build vmap's plans
        (few, t_few), (many, t_many) = count(make, low), count(make, high)
        per = {op: (many[op] - few[op]) / (high - low) for op in many}
        total = sum(per.values())
        kernels = sum(n for op, n in per.items() if op not in VIEWS)
        top = ", ".join(f"{op} {n:g}" for op, n in sorted(per.items(), key=lambda x: -x[1])[:12] if n)
        print(f"{name}: {total:g} operators per iteration, {kernels:g} of them computing (not views), "
              f"{1000 * (t_many - t_few) / (high - low):.1f} ms per iteration on one CPU thread; most: {top}")


if __name__ == "__main__":
    main()
