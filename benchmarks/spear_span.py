"""spear_span's time and reach at 64 and 256 images per update: the inputs of the zoo's mlp's first layer found
exactly from one undefended gradient, untrained and after training steps, on Fashion-MNIST.

Case: Fashion-MNIST test images (Debian's dataset-fashion-mnist) at ``--size`` px, normalised by the training
split's mean and spread; the zoo's ``mlp`` (two hidden ReLU layers of ``--width`` units), plain SGD at lr 0.1 on
batches of 64 training images for ``--steps`` steps; the gradient of the mean cross-entropy of one batch of
``b`` test images, in float32 as a client sends it. Prints per batch size the inputs found, the originals they
name (each found input's nearest, counted once), the median and worst found input's distance to its nearest original
(relative to that original's norm: float32 gradients bound it), the rounds and the wall time. ``--sigma`` adds
Gaussian noise of that spread to both layers' gradients, as the ``gaussian`` defense does (one draw per case).

    python benchmarks/spear_span.py [--batches 64,256] [--size 28] [--width 1024] [--steps 0,300] [--threads 2]
                                    [--starts N] [--adam-steps N] [--rounds N] [--sigma 0,1e-6]

(``--starts``, ``--adam-steps`` and ``--rounds`` replace the CPU budget's, to find where its reach ends.)

(256 images need a first layer and a next layer wider than 256: the defaults, 28 px and 1024 units.)
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F

from leakaudit.attacks.decomposition import SpearSpan, span_inputs
from leakaudit.evaluator.zoo.datasets import load_fashion_mnist
from leakaudit.evaluator.zoo.models import mlp


def case(batch: int, size: int, width: int, steps: int):
    """The first two layers' weight gradients of ``batch`` test images, the model, and the normalised images."""
    data = load_fashion_mnist(image_size=size)
    mean, std = data.train_x.mean(), data.train_x.std()
    torch.manual_seed(0)
    model = mlp(1, 10, size, width=width)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        pick = torch.randint(0, len(data.train_x), (64,), generator=generator)
        loss = F.cross_entropy(model((data.train_x[pick] - mean) / std), data.train_y[pick])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    pick = torch.randperm(len(data.test_x), generator=generator)[:batch]
    x = (data.test_x[pick] - mean) / std
    grads = torch.autograd.grad(F.cross_entropy(model(x), data.test_y[pick]), [model[1].weight, model[3].weight])
    return model, x.flatten(1), [g.double() for g in grads]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--size", type=int, default=28)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", default="0,300")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--starts", type=int)
    parser.add_argument("--adam-steps", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--sigma", default="0", help="spreads of Gaussian noise added to the gradients")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = {**{k: p.default for k, p in SpearSpan.params.items()}, **SpearSpan.auto_params["cpu"],
              **{k: v for k, v in (("starts", args.starts), ("steps", args.adam_steps), ("rounds", args.rounds))
                 if v is not None}}
    print(f"spear_span (starts {params['starts']}, steps {params['steps']}, rounds "
          f"{params['rounds']}), mlp of width {args.width}, {args.size} px, {args.threads} threads")
    print("| images | training steps | sigma | found | originals named | median relative error | worst | rounds | "
          "seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch, steps, sigma in itertools.product(map(int, args.batches.split(",")), map(int, args.steps.split(",")),
                                                 map(float, args.sigma.split(","))):
        model, x, (gw, gw2) = case(batch, args.size, args.width, steps)
        noise = torch.Generator().manual_seed(2)
        gw, gw2 = (g + sigma * torch.randn(g.shape, generator=noise).to(g) for g in (gw, gw2))
        start = time.perf_counter()
        found, info = span_inputs(gw, gw2, model[1], batch, params["starts"], params["steps"], params["rounds"],
                                  params["lr"], params["tolerance"], torch.Generator().manual_seed(0))
        seconds = time.perf_counter() - start
        distance = torch.cdist(found[:info["found"]], x.double()) / x.double().norm(dim=1)
        named = len(set(distance.argmin(dim=1).tolist()))
        nearest = distance.min(dim=1).values if info["found"] else torch.full((1,), float("nan"))
        print(f"| {batch} | {steps} | {sigma:g} | {info['found']} | {named} | {float(nearest.median()):.1e} | "
              f"{float(nearest.max()):.1e} | {info['rounds']} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
