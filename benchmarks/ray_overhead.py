"""What the Ray executor costs: one audit's wall time on the local worker processes and on a one-machine Ray
cluster with as many CPUs, and their ratio.

The audit is a small but real one (digits, lenet_zhu trained 5 steps, no defense and Gaussian noise, two
checkpoints, ``inverting_gradients``): 2 training runs and ``2 x 2 x targets`` attack jobs. Ray's time is
given with and without starting the cluster (``ray.init``), which a long audit pays once. The rows of the
two runs are compared too: they must be the same numbers.

    python benchmarks/ray_overhead.py [--cpus 2] [--targets 4] [--iterations 200]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
import yaml

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.run.runner import run_audit

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from conftest import small_audit  # noqa: E402  (the tests' small audit)


def timed_run(path: Path, out: Path) -> tuple[float, list[dict]]:
    started = time.perf_counter()
    run_audit(load_audit(path), out, progress=False)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return time.perf_counter() - started, sorted(({k: v for k, v in r.items() if k != "seconds"} for r in rows),
                                                 key=lambda r: (r["setting"], r["checkpoint"], r["target"]))


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--cpus", type=int, default=2, help="local worker processes, and the Ray cluster's CPUs")
    args.add_argument("--targets", type=int, default=4)
    args.add_argument("--iterations", type=int, default=200)
    opts = args.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        audit = small_audit(model={"name": "lenet_zhu", "checkpoints": [0, 5]}, workers=opts.cpus,
                            data={"dataset": "digits", "image_size": 16, "targets": opts.targets, "batch_size": 1},
                            attacks=[{"name": "inverting_gradients", "params": {"iterations": opts.iterations}}])
        local_file, ray_file = Path(tmp, "local.yaml"), Path(tmp, "ray.yaml")
        local_file.write_text(yaml.safe_dump(audit))
        ray_file.write_text(yaml.safe_dump({**audit, "executor": "ray"}))
        local_s, local_rows = timed_run(local_file, Path(tmp, "local"))
        started = time.perf_counter()
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=opts.cpus, include_dashboard=False, logging_level="warning")
        start_s = time.perf_counter() - started
        ray_s, ray_rows = timed_run(ray_file, Path(tmp, "ray"))
        ray.shutdown()
    jobs = len(local_rows)
    print(f"audit: 2 training runs and {jobs} attack jobs ({opts.iterations} iterations), {opts.cpus} CPUs")
    print(f"local worker processes: {local_s:.1f} s")
    print(f"ray, one machine:       {ray_s:.1f} s (+ {start_s:.1f} s to start the cluster)")
    print(f"ratio ray / local:      {ray_s / local_s:.2f} ({(ray_s + start_s) / local_s:.2f} with the start)")
    print(f"same rows:              {ray_rows == local_rows}")


if __name__ == "__main__":
    main()
