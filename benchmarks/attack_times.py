"""Seconds per reconstruction on a fully Bayesian network, in the form of Chen et al.'s (2024) supplement, Table 1.

Case: one 32x32 CIFAR-10 image of the foolbox wheel, its update through a network whose every Linear and
Conv2d layer is Bayesian (``bayesian`` with ``layers: all``): VB-ResNet-18 (the zoo's ResNet-18) or
BL-ConvNet (Geiping et al.'s ConvNet, ``--width``), untrained. The budgets are the paper's: 1,200 L-BFGS
iterations for DLG and iDLG, 13,000 Adam iterations for Inverting Gradients and ``bayesian_kl``.
Prints seconds per attack and ``bayesian_kl``'s time over Inverting Gradients' (the paper: 489.04 s
against 472.05 s on VB-ResNet-18, 1.04; 293.19 against 332.90 on BL-ConvNet). ``--fraction`` runs that
share of every budget and scales the seconds up, for CPUs.

    python benchmarks/attack_times.py [--model resnet18|convnet] [--width 64] [--device cuda] [--fraction 1]
"""
from __future__ import annotations

import argparse
import time

import torch

from leakaudit.attacks.bayesian import BayesianNoiseKL
from leakaudit.attacks.gradient_matching import DeepLeakage, ImprovedDeepLeakage, InvertingGradients
from leakaudit.defenses.bayesian import Bayesian
from leakaudit.evaluator.run.scenario import loss_fn
from leakaudit.evaluator.zoo.models import convnet, resnet18
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.protocol import ClientStep

LBFGS_ITERATIONS = 1200  # DLG and iDLG (Chen et al. 2024, supplement Sec. 3)
ADAM_ITERATIONS = 13000  # Inverting Gradients and theirs


def case(model_name: str, width: int, device: str):
    """The Bayesian network, its defense, one image's shared update and the attacker's threat model."""
    data = load_registry().get("dataset", "cifar10_samples").load(image_size=32, root=None, download=False)
    mean, std = data.mean.view(-1, 1, 1).to(device), data.std.view(-1, 1, 1).to(device)
    pixels, label = data.test_x[:1].to(device), data.test_y[:1].to(device)
    torch.manual_seed(0)
    plain = resnet18(3, 10, 32) if model_name == "resnet18" else convnet(3, 10, 32, width=width)
    defense = Bayesian(layers="all")
    model = defense.wrap_model(plain).to(device)
    step = ClientStep(model, loss_fn, (pixels - mean) / std, label, torch.Generator(device=device).manual_seed(0))
    observed = defense.share(step)
    threat = ThreatModel(model, loss_fn, (3, 32, 32), mean, std, 10, 1, defense, labels=label,
                         device=torch.device(device))
    return observed, threat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=["resnet18", "convnet"])
    parser.add_argument("--width", type=int, default=64, help="ConvNet width (BL-ConvNet)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fraction", type=float, default=1.0, help="share of each budget run (seconds scaled up)")
    args = parser.parse_args()
    observed, threat = case(args.model, args.width, args.device)
    lbfgs, adam = (max(1, round(n * args.fraction)) for n in (LBFGS_ITERATIONS, ADAM_ITERATIONS))
    attacks = [DeepLeakage(iterations=lbfgs, restarts=1), ImprovedDeepLeakage(iterations=lbfgs, restarts=1),
               InvertingGradients(iterations=adam), BayesianNoiseKL(iterations=adam)]
    parameters = sum(p.numel() for p in threat.model.parameters())
    print(f"{args.model} (Bayesian, {parameters} parameters) on {args.device}, budgets {lbfgs} L-BFGS / {adam} Adam "
          f"iterations (fraction {args.fraction} of the paper's)", flush=True)
    seconds = {}
    for attack in attacks:
        start = time.perf_counter()
        attack(observed, threat, torch.Generator(device=args.device).manual_seed(1))
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds[attack.name] = (time.perf_counter() - start) / args.fraction
        print(f"  {attack.name:20s} {seconds[attack.name]:9.1f} s (at the paper's budget)", flush=True)
    print(f"  bayesian_kl / inverting_gradients: {seconds['bayesian_kl'] / seconds['inverting_gradients']:.2f} "
          "(Chen et al. 2024: 1.04 on VB-ResNet-18, 0.88 on BL-ConvNet)")


if __name__ == "__main__":
    main()
