"""Soteria's feature scores: one batched backward pass per chunk of features against one per feature.

Case: ConvBig (Balunovic et al. 2022, Table 3) on 32x32 random images; the defended layer is fc1, whose
5184 input features each need d r_f / d x. Prints seconds per share for the per-feature loop
of the reference code (timed on ``--loop-features`` features and scaled to all of them) and
for ``defenses.soteria.feature_scores`` (``is_grads_batched`` over chunks of CHUNK features),
for batches of 1 and 4, and checks that both give the same scores on the features timed.

    python benchmarks/soteria_scores.py [--device cpu] [--loop-features 256]
"""
from __future__ import annotations

import argparse
import time

import torch

from leakaudit.defenses import soteria
from leakaudit.evaluator.zoo.models import convbig


def loop_scores(model, x: torch.Tensor, features: int) -> torch.Tensor:
    """The reference code's way: one backward pass per feature, for the first ``features`` features."""
    captured = []
    handle = model.fc1.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    xr = x.clone().requires_grad_(True)
    model(xr)
    handle.remove()
    r = captured[0]
    out = torch.zeros(features, device=x.device)
    for f in range(features):
        (dx,) = torch.autograd.grad(r[:, f].sum(), xr, retain_graph=True)
        per_example = dx.flatten(1).norm(dim=1) / r[:, f].detach().abs()
        out[f] = torch.where(r[:, f] != 0, per_example, torch.zeros_like(per_example)).sum()
    return out


def timed(fn, device: str):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--loop-features", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = convbig(3, 10, 32).to(args.device)
    n = model.fc1.in_features
    print(f"device {args.device}, {torch.get_num_threads()} thread(s), {n} features, chunk {soteria.CHUNK}")
    for batch in (1, 4):
        x = torch.rand(batch, 3, 32, 32, device=args.device)
        reference, t_loop = timed(lambda: loop_scores(model, x, args.loop_features), args.device)
        scores, t_batched = timed(lambda: soteria.feature_scores(model, model.fc1, x), args.device)
        live = ~scores[:args.loop_features].isnan()
        agree = torch.allclose(scores[:args.loop_features][live], reference[live], rtol=1e-4, atol=1e-6)
        loop_all = t_loop * n / args.loop_features
        print(f"batch {batch}: per-feature loop {loop_all:.2f} s (scaled from {args.loop_features} features), "
              f"batched {t_batched:.2f} s, speed-up {loop_all / t_batched:.1f}x, same scores: {agree}")


if __name__ == "__main__":
    main()
