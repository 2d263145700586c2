"""CI-Net on large batches (Zhang et al. 2023): SSIM, PSNR and time for batches of 64 to 256 on one averaged gradient.

Case: an untrained ConvNet (Geiping et al. 2020, width 16, ReLU or sigmoid) or the zoo's ResNet-18 with
sigmoids (Zhang et al.'s victim), in train or eval mode (``--mode``), on 32x32 images drawn from the offline
sets (the 20 CIFAR-10 images of the foolbox wheel are too few, so scikit-image's photographs and LFW faces are
tiled into the batch), labels known.
Prints one line per (model, batch): mean SSIM and PSNR of ``cinet`` and of Inverting Gradients
at the same iteration budget, a flat grey guess, and seconds. A GPU workload: on a CPU use
small batches and few iterations.

    python benchmarks/cinet_batches.py [--device cuda] [--batches 64 128 256] [--iterations 2000] \\
        [--models sigmoid_resnet18] [--mode train]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from leakaudit.attacks.cinet import CINet, parameter_count
from leakaudit.attacks.gradient_matching import InvertingGradients
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.zoo.metrics import score
from leakaudit.evaluator.zoo.models import convnet, resnet18
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.protocol import ClientStep


def images(registry, count: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` RGB 32x32 images and labels in 0..9, tiled from the offline photo and face sets."""
    pool = []
    for name in ("cifar10_samples", "photos", "lfw"):
        data = registry.get("dataset", name).load(image_size=32, root=None, download=False)
        x = torch.cat([data.test_x, data.train_x])
        pool.append(x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x)
    x = torch.cat(pool)
    x = x[torch.arange(count) % len(x)]
    return x.to(device), (torch.arange(count) % 10).to(device)


MODELS = {"convnet": lambda: convnet(3, 10, 32, width=16),
          "sigmoid_convnet": lambda: convnet(3, 10, 32, width=16, activation="sigmoid"),
          "sigmoid_resnet18": lambda: resnet18(3, 10, 32, activation="sigmoid")}


def run(model_name: str, batch: int, iterations: int, device: str, mode: str, registry) -> None:
    pixels, labels = images(registry, batch, device)
    mean = pixels.mean(dim=(0, 2, 3)).view(-1, 1, 1)
    std = pixels.std(dim=(0, 2, 3)).view(-1, 1, 1)
    torch.manual_seed(0)
    model = MODELS[model_name]().to(device).train(mode == "train")
    observed = NoDefense().share(ClientStep(model, F.cross_entropy, (pixels - mean) / std, labels,
                                            torch.Generator(device=device)))
    threat = ThreatModel(model, F.cross_entropy, (3, 32, 32), mean, std, 10, batch, NoDefense(), labels=labels,
                         device=torch.device(device))
    metrics = [registry.get("metric", "ssim"), registry.get("metric", "psnr")]
    grey = score(metrics, torch.full_like(pixels, 0.5), pixels, labels, labels)[0]
    line = [f"{model_name} ({parameter_count(model)} parameters, {mode} mode), batch {batch}, {iterations} iterations: "
            f"grey SSIM {grey['ssim']:.3f}"]
    for attack in (CINet(iterations=iterations), InvertingGradients(iterations=iterations)):
        start = time.perf_counter()
        rec = attack(observed, threat, torch.Generator(device=device).manual_seed(1))
        if device == "cuda":
            torch.cuda.synchronize()
        values = score(metrics, rec.images, pixels, rec.labels, labels)[0]
        line.append(f"{attack.name} SSIM {values['ssim']:.3f} PSNR {values['psnr']:.2f} "
                    f"({time.perf_counter() - start:.0f} s)")
    print("; ".join(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--models", nargs="+", default=["sigmoid_resnet18"], choices=sorted(MODELS))
    parser.add_argument("--mode", default="train", choices=["train", "eval"],
                        help="BatchNorm of the attacked model: batch statistics (train, Zhang et al.) or running ones")
    args = parser.parse_args()
    registry = load_registry()
    for model_name in args.models:
        for batch in args.batches:
            run(model_name, batch, args.iterations, args.device, args.mode, registry)


if __name__ == "__main__":
    main()
