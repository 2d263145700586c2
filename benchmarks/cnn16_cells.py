"""Seconds per cell of Learning to Invert and CI-Net on configs/realistic_cnn16.yaml's case, before and after.

Case: the audit's cnn_bayes (Balunovic et al. 2022) on scikit-learn's digits at 16 px, untrained (seed 0), 16
images per update, the attacker's images the training split less 32 targets, Gaussian noise of sigma 0.1, the
attacks at their CPU budgets (``auto_params``). Prints, on one torch thread (a stage's cells on every worker) and on
two (a stage's lone cell, which the workers' pool now runs on the idle workers' cores too): Learning to Invert's
simulated updates looped (``Defense.share`` per update: before, and after on one thread) and in vmapped chunks of
``CHUNK`` (after, on more threads), its network's training, and CI-Net's two targets.

    python benchmarks/cnn16_cells.py [--threads 1 2] [--updates 2048] [--cinet-iterations 1000]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

from leakaudit.attacks import learned
from leakaudit.attacks.cinet import CINet
from leakaudit.attacks.learned import LearningToInvert, coordinates, fit_inversion, training_updates
from leakaudit.defenses.noise import GaussianNoise
from leakaudit.evaluator.zoo.models import cnn_bayes
from leakaudit.plugins.attack import AuxiliaryData, ThreatModel
from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.protocol import ClientStep

T = TypeVar("T")

def case() -> tuple[ThreatModel, object]:
    """The audit's threat at step 0 under gaussian(sigma=0.1), and one target batch's shared update."""
    data = load_registry().get("dataset", "digits").load(image_size=16, root=None, download=False)
    x, y = data.train_x, data.train_y
    torch.manual_seed(0)
    model = cnn_bayes(1, 10, 16)
    defense = GaussianNoise(sigma=0.1)
    mean, std = x.mean(dim=(0, 2, 3)).view(-1, 1, 1), x.std(dim=(0, 2, 3)).view(-1, 1, 1)
    threat = ThreatModel(model, F.cross_entropy, (1, 16, 16), mean, std, 10, 16, defense,
                         auxiliary=AuxiliaryData(x, y, torch.arange(32, len(x))))
    step = ClientStep(model, F.cross_entropy, threat.normalise(x[:16]), y[:16], torch.Generator().manual_seed(1))
    return threat, defense.share(step)


def timed(work: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    out = work()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--updates", type=int, default=LearningToInvert.auto_params["cpu"]["updates"])
    parser.add_argument("--cinet-iterations", type=int, default=CINet.auto_params["cpu"]["iterations"])
    args = parser.parse_args()
    threat, observed = case()
    l2i = LearningToInvert(**{**LearningToInvert.auto_params["cpu"], "updates": args.updates})
    picked = coordinates(observed, l2i.coordinates, 0, threat.device)

    def updates(chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        learned.chunk_for = lambda threat, count: chunk  # 1: the loop, one Defense.share per update
        return training_updates(threat, picked, args.updates, torch.Generator().manual_seed(2),
                                torch.Generator().manual_seed(3))

    for threads in args.threads:
        torch.set_num_threads(threads)
        looped, _ = timed(lambda: updates(1))
        vmapped, (inputs, targets) = timed(lambda: updates(learned.CHUNK))
        fit, _ = timed(lambda: fit_inversion(inputs, targets, l2i.width, l2i.iterations, l2i.minibatch, l2i.lr,
                                             torch.Generator().manual_seed(4)))
        cinet, _ = timed(lambda: CINet(iterations=args.cinet_iterations)(observed, threat,
                                                                          torch.Generator().manual_seed(5)))
        after = vmapped if threads > 1 else looped
        print(f"{threads} thread(s): learning_to_invert {looped + fit:.1f} s a cell before, {after + fit:.1f} after "
              f"(simulated updates {looped:.1f} looped, {vmapped:.1f} vmapped; network {fit:.1f}); cinet "
              f"{2 * cinet:.1f} s a cell of 2 targets", flush=True)


if __name__ == "__main__":
    main()
