"""ARES (Gong et al. 2026) beside imprint (Fowl et al. 2022) on the same batches: what a malicious server reads from
one FedSGD update when it only crafts the weights of cnn_bayes, against when it adds an imprint block of as many
bins in front of the same network.

For each case (dataset, image side, batch) it prints, for both attacks: the images recovered (PSNR over 20 dB,
each original against the reconstruction the best assignment gives it), the count the expected recovery rate
predicts for the bins, the mean PSNR of the recovered images, and the attack's seconds. Labels are known; the
update is undefended unless ``--sigma`` adds Gaussian noise to every coordinate.

    python benchmarks/ares_imprint.py [--device cpu] [--sigma 0]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment

from leakaudit.attacks.ares import Ares, crafted_layout, expected_recovery_rate
from leakaudit.attacks.imprint import Imprint
from leakaudit.evaluator.zoo.models import ares, imprint
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.manager import load_registry

CASES = (("fashion_mnist", 28, 8), ("fashion_mnist", 28, 64), ("cifar10_samples", 32, 8), ("photos", 32, 8),
         ("photos", 32, 64))
RECOVERED_DB = 20.0


def assigned_psnr(found: torch.Tensor, originals: torch.Tensor) -> torch.Tensor:
    """Each original's PSNR against the reconstruction the best one-to-one assignment gives it."""
    mse = ((found[None] - originals[:, None]) ** 2).flatten(2).mean(2)
    psnr = -10 * torch.log10(mse.clamp_min(1e-12))
    rows, cols = linear_sum_assignment(-psnr.cpu().numpy())
    return psnr[torch.as_tensor(rows), torch.as_tensor(cols)]


def attack_once(model, attack, images, labels, data, device, sigma: float) -> tuple[torch.Tensor, float]:
    """The attack's per-image PSNR on the FedSGD update of ``images`` and its seconds."""
    mean, std = data.mean.view(-1, 1, 1).to(device), data.std.view(-1, 1, 1).to(device)
    names, params = zip(*model.named_parameters())
    clean = torch.autograd.grad(F.cross_entropy(model((images - mean) / std), labels), params)
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [g + sigma * torch.randn(g.shape, generator=gen, device=device) for g in clean]
    threat = ThreatModel(model, F.cross_entropy, tuple(images.shape[1:]), mean, std, data.num_classes, len(images),
                         load_registry().get("defense", "none")(), labels=labels, device=torch.device(device))
    start = time.perf_counter()
    found = attack(SharedUpdate(list(grads), list(names), len(images)), threat, gen).images
    if device == "cuda":
        torch.cuda.synchronize()
    return assigned_psnr(found, images), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sigma", type=float, default=0.0)
    args = parser.parse_args()
    registry = load_registry()
    print("| data | batch | attack | recovered (> 20 dB) | expected | mean PSNR of those | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, side, batch in CASES:
        data = registry.get("dataset", name).load(image_size=side, root=None, download=False)
        images, labels = data.test_x[:batch].to(args.device), data.test_y[:batch].to(args.device)
        channels = images.shape[1]
        torch.manual_seed(0)
        crafted = ares(channels, data.num_classes, side, base="cnn_bayes").to(args.device)
        bins = crafted_layout(crafted).imprint.out_features
        torch.manual_seed(0)
        blocked = imprint(channels, data.num_classes, side, base="cnn_bayes", bins=bins).to(args.device)
        expected = batch * expected_recovery_rate(bins, batch)
        for label, model, attack in (("ares", crafted, Ares()), (f"imprint ({bins} bins)", blocked, Imprint())):
            psnr, seconds = attack_once(model, attack, images, labels, data, args.device, args.sigma)
            hit = psnr[psnr > RECOVERED_DB]
            mean = f"{hit.mean():.1f} dB" if len(hit) else "-"
            print(f"| {name} {side} px | {batch} | {label} | {len(hit)} | {expected:.1f} | {mean} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
