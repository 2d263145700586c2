"""The pretrained model and the natural photos offline: what they cost before an attack starts.

gcompris_photos: decoding GCompris's photos from Debian's resource bundles (an empty cache), then reading them back
from the cache; its size. efficientnet_lite0: building it from the ImageNet weights (SHA-256 checked), then one
client step's forward and backward pass (cross-entropy, BatchNorm in training mode) at a batch of ``--batch``
photos per image side; the median of ``--repeat`` after one warm-up.

    python benchmarks/pretrained_zoo.py [--sizes 32,64,96,128] [--batch 64] [--repeat 3] [--device cpu] [--threads N]

Run it alone on the machine: other work in parallel inflates every figure, and on a busy machine torch's threads
wait for each other spinning (on 2 shared cores at load 9, two threads took 7 s of CPU for what one thread did in
0.9 s): there, pass --threads 1.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import measured_on  # noqa: E402


def photos(image_size: int) -> None:
    """Decode time from an empty cache, read time from the cache, and the dataset's size."""
    from leakaudit.evaluator.zoo import gcompris

    with tempfile.TemporaryDirectory() as cache:
        os.environ["LEAKAUDIT_DATA"] = cache
        start = time.perf_counter()
        images, labels, _ = gcompris.load_arrays(image_size)
        decode = time.perf_counter() - start
        start = time.perf_counter()
        gcompris.load_arrays(image_size)
        cached = time.perf_counter() - start
        size = sum(f.stat().st_size for f in Path(cache).rglob("*.npz"))
    counts = ", ".join(f"{name} {int((labels == i).sum())}" for i, name in enumerate(gcompris.CLASSES))
    bundles = sum((gcompris.RCC_DIR / f"{b}.rcc").stat().st_size for b in {b for b, _, _ in gcompris.SOURCES})
    print(f"gcompris_photos: {len(images)} distinct photos ({counts}) from {bundles / 1e6:.1f} MB of bundles; "
          f"decoded at {image_size} px in {decode:.2f} s, read from the cache ({size / 1e6:.2f} MB) in {cached:.3f} s")


def step_time(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, repeat: int) -> tuple[float, float]:
    """The median wall time and CPU time (this process's, all threads: what other work on the machine inflates
    least) of one forward and backward pass, after a warm-up."""
    walls, cpus = [], []
    for i in range(repeat + 1):
        model.zero_grad(set_to_none=True)
        if x.is_cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if x.is_cuda:
            torch.cuda.synchronize()
        if i:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def model_steps(sizes: list[int], batch: int, repeat: int, device: str) -> None:
    """efficientnet_lite0's build time and its forward and backward time per image side."""
    from leakaudit.evaluator.zoo.models import ZOO, build_model

    spec = next(s for s in ZOO if s.name == "efficientnet_lite0")
    gen = torch.Generator().manual_seed(0)
    for side in sizes:
        start = time.perf_counter()
        model = build_model(spec, {"channels": 3, "num_classes": 7, "image_size": side}, {}, seed=0).to(device)
        built = time.perf_counter() - start
        x = torch.rand(batch, 3, side, side, generator=gen).to(device)
        y = torch.randint(0, 7, (batch,), generator=gen).to(device)
        wall, cpu = step_time(model.train(), x, y, repeat)
        print(f"efficientnet_lite0 at {side} px: built in {built:.2f} s; forward + backward of {batch} images "
              f"{wall:.3f} s wall ({batch / wall:.0f} images/s), {cpu:.3f} s CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32,64,96,128")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"measured on {measured_on() if args.device == 'cpu' else torch.cuda.get_device_name()}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    sizes = [int(s) for s in args.sizes.split(",")]
    photos(64)
    model_steps(sizes, args.batch, args.repeat, args.device)


if __name__ == "__main__":
    main()
