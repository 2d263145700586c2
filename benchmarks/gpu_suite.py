"""The GPU suite: one command that measures the GPU path and the paper-scale cases whenever a GPU is lent.

    python benchmarks/gpu_suite.py --out runs/gpu_suite              # on a GPU of about 80 GB: within 25 minutes
    python benchmarks/gpu_suite.py --smoke --device cpu --out DIR    # every code path at toy sizes (the tests run it)
    python benchmarks/gpu_suite.py --compile --only throughput_lenet --ks 1,64,4096   # as audits with compile: true

Writes ``DIR/gpu_suite.json`` (every figure, with the machine and versions) and ``DIR/gpu_suite.md`` (the tables
for docs/results.md), each section as soon as it is measured, so a run cut short keeps what it measured:

- throughput: ``inverting_gradients`` on the untrained ``lenet_zhu`` at 32 px for K problems solved together, in
  image-iterations per second, and its ratio to K = 1 (the figure that holds across machines); ResNet-18 with the
  ImageNet stem at 224 px, 8 targets;
- the quickstart on the GPU against the CPU of the same machine, and with ``deterministic: false``;
- ``precision: bfloat16`` against float32: LeNet's throughput at K = 64 and the quickstart's scores;
- the paper-scale cases at a budget that fits, each stated beside the paper's: CI-Net on a batch of 64 (Zhang et
  al. 2023, SSIM), the ResNet column of Geiping et al. 2020 Table 1 (PSNR, the first validation images),
  Table 2 MNIST of Balunovic et al. 2022, and ``bayesian_kl`` (Chen et al. 2024) at a fifth of its 13,000
  iterations on one target, its attack time scaled to the whole budget (the supplement's timing table).

Datasets the machine lacks (CIFAR-10, MNIST under ``data/``) are replaced by the offline samples of the foolbox
wheel, and the table says so. A case that fails is recorded with its one-line error and the suite goes on.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
#: Offline stand-ins for the torchvision sets a shipped audit reads from ``root:``.
STAND_INS = {"cifar10": "cifar10_samples", "mnist": "mnist_samples"}
#: The training images a stand-in holds (the foolbox wheel's 20 test images, split 10 and 10).
STAND_IN_IMAGES = 10


def audit_dict(name: str, changes: dict[str, Any]) -> dict[str, Any]:
    """A shipped audit with ``changes`` (dotted keys; list indices as numbers) and its absent data replaced."""
    audit = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    for dotted, value in changes.items():
        *path, last = dotted.split(".")
        node = audit
        for key in path:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value
    data = audit["data"]
    if data.get("root") and not (ROOT / data["root"]).is_dir() and data["dataset"] in STAND_INS:
        audit["data"] = {**data, "dataset": STAND_INS[data["dataset"]], "root": None, "params": {},
                         "targets": min(data["targets"], STAND_IN_IMAGES // data.get("batch_size", 1))}
    return audit


def run_case(audit: dict[str, Any], folder: Path) -> tuple[dict[str, Any], float]:
    """Run ``audit`` into ``folder``; its summary and wall seconds."""
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.runner import run_audit

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "audit.yaml"
    path.write_text(yaml.safe_dump(audit, sort_keys=False))
    started = time.perf_counter()
    summary = run_audit(load_audit(path), folder / "run", progress=False)
    return summary, time.perf_counter() - started


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def throughput(device: str, ks: list[int], iterations: int, model: str, image_size: int,
               compiled: bool = False, precision: str = "float32") -> list[dict[str, Any]]:
    """Image-iterations per second of vectorised ``inverting_gradients`` on K problems (one target each); ``compiled``:
    as an audit with ``compile: true`` runs them (on CUDA, whole iterations replayed as CUDA graphs); ``precision``:
    as with ``precision: bfloat16``."""
    from leakaudit.attacks.vectorised import autocast_steps, compile_steps
    from leakaudit.attacks.gradient_matching import InvertingGradients
    from leakaudit.defenses.noise import NoDefense
    from leakaudit.evaluator.run.scenario import loss_fn
    from leakaudit.evaluator.zoo.datasets import load_photos
    from leakaudit.evaluator.zoo.models import build_model
    from leakaudit.plugins.attack import Problem, ThreatModel
    from leakaudit.plugins.manager import load_registry
    from leakaudit.plugins.protocol import ClientStep

    registry = load_registry(entry_points=False)
    data = load_photos(image_size, crops=max(2, max(ks) // 7 + 1))
    torch.manual_seed(0)
    net = build_model(registry.get("model", model), {"channels": data.channels, "num_classes": data.num_classes, "image_size": image_size}, {}, 0).to(device)
    mean, std = data.mean.view(-1, 1, 1).to(device), data.std.view(-1, 1, 1).to(device)

    def make(k: int, budget: int) -> list[Problem]:
        problems = []
        for i in range(k):
            pixels = data.train_x[i % len(data.train_x)][None].to(device)
            label = data.train_y[i % len(data.train_y)][None].to(device)
            gen = torch.Generator(device=device).manual_seed(i)
            observed = NoDefense().share(ClientStep(net, loss_fn, (pixels - mean) / std, label, gen))
            threat = ThreatModel(net, loss_fn, tuple(pixels.shape[1:]), mean, std, data.num_classes, 1, NoDefense(),
                                 labels=label, device=torch.device(device))
            problems.append(Problem(observed, threat, gen, InvertingGradients(iterations=budget)))
        return problems

    rows, base = [], None
    restore, restore_precision = compile_steps(compiled, cuda_graphs=device.startswith("cuda")), autocast_steps(precision)
    try:
        for k in ks:
            InvertingGradients.reconstruct_all(make(k, 3))  # one-time costs (kernels, compilation) before the clock
            problems = make(k, iterations)
            _sync(device)
            started = time.perf_counter()
            InvertingGradients.reconstruct_all(problems)
            _sync(device)
            rate = k * iterations / (time.perf_counter() - started)
            base = base or rate
            rows.append({"model": model, "image_size": image_size, "K": k, "iterations": iterations,
                         "compiled": compiled, "precision": precision, "image_iterations_per_s": round(rate, 1),
                         "ratio_to_K1": round(rate / base, 2)})
    finally:
        restore()
        restore_precision()
    return rows


def quickstart(device: str, smoke: bool, compiled: bool = False,
               variants: list[tuple[str, bool, str]] | None = None) -> list[dict[str, Any]]:
    """The quickstart on ``device`` (and the CPU beside it, and with ``deterministic: false`` on CUDA), or in
    ``variants`` of (device, deterministic, precision)."""
    small = {"data.targets": 1, "attacks.0.params.iterations": 2, "utility.train_steps": 2} if smoke else {}
    small = {**small, "compile": compiled}
    variants = variants or ([(device, True, "float32")]
                            + ([("cpu", True, "float32"), (device, False, "float32")] if device != "cpu" else []))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (where, deterministic, precision) in enumerate(variants):
            audit = audit_dict("quickstart", {**small, "device": where, "deterministic": deterministic,
                                              "precision": precision})
            summary, seconds = run_case(audit, Path(tmp) / str(i))
            top = max(summary.cells, key=lambda c: c.mean("psnr"))
            rows.append({"device": where, "deterministic": deterministic, "precision": precision,
                         "wall_s": round(seconds, 1), "best_psnr": round(top.mean("psnr"), 2),
                         "psnr_by_cell": {f"{c.setting}/{c.attack}": round(c.mean("psnr"), 2) for c in summary.cells}})
    return rows


def precision(device: str, smoke: bool, compiled: bool = False) -> list[dict[str, Any]]:
    """``precision: bfloat16`` against float32 on the same machine: LeNet's throughput at K = 64 and the quickstart's
    scores (every setting's PSNR, so the effect on the scores is read beside the speed)."""
    k, iterations = (2, 2) if smoke else (64, 100)
    rows = []
    for name in ("float32", "bfloat16"):
        rate = throughput(device, [k], iterations, "lenet_zhu", 32, compiled, name)[0]["image_iterations_per_s"]
        row = quickstart(device, smoke, compiled, [(device, False, name)])[0]
        rows.append({"precision": name, f"lenet_K{k}_image_iterations_per_s": rate, **row})
    return rows


def text(case: str, device: str, smoke: bool, compiled: bool = False) -> list[dict[str, Any]]:
    """One text audit on ``device``: DAGER at scale (``dager_scale``: 32 sentences per update on a model of GPT-2's
    width), TAG against LAMP at their full budget (``tag_lamp``: 2,500 iterations, updates of two sentences), or
    the text quickstart with TAG and the Bayes adversary at that budget (``quickstart``), or the keyboard's language
    model so (``keyboard``); each setting's strongest attack and every attack's ROUGE-2."""
    toy = {"data.targets": 2, "utility.train_steps": 1, "model.params": {"width": 32, "layers": 3, "heads": 4}}
    full = 2 if smoke else 2500
    cases = {
        "dager_scale": {**toy, "data.batch_size": 2,
                        "defenses": [{"name": "none"}, {"name": "lora", "params": {"rank": 8}}]} if smoke else {},
        "tag_lamp": {"data.batch_size": 2, "data.targets": 4, "defenses": [{"name": "none"}],
                     "attacks": [{"name": "tag", "params": {"iterations": full}},
                                 {"name": "lamp", "params": {"iterations": full}}], **(toy if smoke else {})},
        "quickstart": {"attacks.1.params.iterations": full, "attacks.3.params.iterations": full,
                       **(toy if smoke else {})},
    }
    cases["keyboard"] = cases["quickstart"]  # the same attacks, in the same places of its file
    config = {"dager_scale": "text_dager_scale", "keyboard": "keyboard"}.get(case, "text_quickstart")
    with tempfile.TemporaryDirectory() as tmp:
        summary, seconds = run_case(audit_dict(config, {**cases[case], "device": device, "compile": compiled}),
                                    Path(tmp))
    return [{"setting": w.setting, "verdict": w.verdict, "strongest": w.attack,
             "rouge1": round(w.scores["rouge1"].mean or 0.0, 3), "wall_s": round(seconds, 1),
             "rouge2_by_attack": {c.attack: round(c.mean("rouge2") or 0.0, 3) for c in summary.cells
                                  if c.setting == w.setting}} for w in summary.worst_case]


#: name: (shipped config, full changes, smoke changes, the metric, what the paper states, the budget stated),
#: in the order they run (the longest last, so a lease that runs out loses the fewest).
PAPER_CASES: dict[str, tuple[str, dict, dict, str, str, str]] = {
    "cinet_batch64": (
        "cinet_batch64", {"attacks.0.params.iterations": 2000, "attacks.1.params.iterations": 2000},
        {"data.targets": 2, "data.batch_size": 2, "attacks.0.params.iterations": 2, "attacks.1.params.iterations": 2,
         "metrics": ["ssim", "psnr"]},
        "ssim", "Zhang et al. 2023: SSIM about 0.9 at batch 64 (20,000 iterations)", "2,000 iterations"),
    "table1_resnet20": (
        "table1_resnet20_paper", {"data.targets": 8, "model.checkpoints": [0], "utility.train_steps": 0,
                                  "attacks": [{"name": "inverting_gradients", "params": {"iterations": 4800, "lr": 0.1,
                                                                                       "priors": {"tv": 0.0}}}]},
        {"data.targets": 1, "model.checkpoints": [0], "utility.train_steps": 0, "model.params": {"width": 4},
         "attacks": [{"name": "inverting_gradients", "params": {"iterations": 2}}], "metrics": ["psnr"]},
        "psnr", "Geiping et al. 2020 Table 1, ResNet-20 untrained, cosine + Adam: 19.83 dB (100 images)",
        "the first 8 images, 4,800 iterations"),
    "table2_mnist": (
        "bayes_table2_mnist_paper", {"model.checkpoints": [0], "defenses": [{"name": "gaussian", "params": {"sigma": 0.1}}],
                                     "attacks": [{"name": "bayes", "params": {"iterations": 200, "lr": 0.5,
                                                                              "lr_decay": 0.000285,
                                                                              "priors": {"tv": 316.0}}}]},
        {"model.checkpoints": [0], "defenses": [{"name": "gaussian", "params": {"sigma": 0.1}}],
         "attacks": [{"name": "bayes", "params": {"iterations": 2}}], "utility.train_steps": 0,
         "data.targets": 1, "metrics": ["psnr"]},
        "psnr", "Balunovic et al. 2022 Table 2, MNIST, Gaussian sigma 0.1 (100 images)", "untuned, step 0"),
    "bayesian_kl": (  # last: the longest; a fifth of the budget on one image, its time scaled to the whole
        "bayesian_full_budget", {"data.targets": 1, "defenses": [{"name": "bayesian", "label": "vb_resnet18",
                                                                   "params": {"layers": "all"}}],
                                 "attacks": [{"name": "bayesian_kl", "params": {"iterations": 2600,
                                                                                "priors": {"tv": 1.0e-4},
                                                                                "alpha_kl": 0.01}}]},
        {"data.targets": 1, "data.image_size": 16,
         "defenses": [{"name": "bayesian", "label": "vb_convnet", "params": {"layers": "all"},
                       "model": {"name": "convnet", "params": {"width": 4}}}],
         "attacks": [{"name": "bayesian_kl", "params": {"iterations": 2}}], "metrics": ["psnr"]},
        "psnr", "Chen et al. 2024 supplement: 489 s per image at 13,000 iterations (VB-ResNet-18, GPU)",
        "2,600 of 13,000 iterations, 1 target"),
}


#: The paper's iterations where a case runs a fraction of them: the attack's time is scaled up to it.
PAPER_BUDGET = {"bayesian_kl": 13000}


def paper_case(name: str, device: str, smoke: bool, compiled: bool = False) -> dict[str, Any]:
    config, full, toy, metric, paper, budget = PAPER_CASES[name]
    audit = audit_dict(config, {**(toy if smoke else full), "device": device, "compile": compiled})
    with tempfile.TemporaryDirectory() as tmp:
        summary, seconds = run_case(audit, Path(tmp))
    cells = {c.attack: round(c.mean(metric), 3) for c in summary.cells if c.mean(metric) is not None}
    per_image = {c.attack: round(c.seconds_mean / audit["data"].get("batch_size", 1) * PAPER_BUDGET.get(
        c.attack, c.iterations) / c.iterations, 1) for c in summary.cells if c.iterations}
    return {"case": name, "dataset": audit["data"]["dataset"], "targets": audit["data"]["targets"], "metric": metric,
            "measured": cells, "wall_s": round(seconds, 1), "budget": "toy (smoke)" if smoke else budget,
            "attack_s_per_image_at_paper_budget": per_image, "paper": paper}


def sections(device: str, smoke: bool, compiled: bool = False, ks: list[int] | None = None) -> dict[str, Callable[[], Any]]:
    """Each section of the suite, at full or toy size, eager or ``compiled``; ``ks``: LeNet's numbers of targets."""
    ks = ks or ([1, 2] if smoke else [1, 64, 512, 4096])
    return {
        "throughput_lenet": lambda: throughput(device, ks, 2 if smoke else 100, "lenet_zhu", 32, compiled),
        "throughput_resnet18_224": lambda: throughput(device, [1, 2] if smoke else [1, 8], 1 if smoke else 20,
                                                      "resnet18", 64 if smoke else 224, compiled),
        "quickstart": lambda: quickstart(device, smoke, compiled),
        "precision": lambda: precision(device, smoke, compiled),
        **{f"text_{case}": (lambda case=case: text(case, device, smoke, compiled))
           for case in ("dager_scale", "tag_lamp", "quickstart", "keyboard")},
        **{f"paper_{name}": (lambda name=name: paper_case(name, device, smoke, compiled)) for name in PAPER_CASES},
    }


def markdown(results: dict[str, Any]) -> str:
    """The results as tables, one per section."""
    lines = [f"# GPU suite: {results['machine']['device']}", "",
             f"torch {results['machine']['torch']}, {results['machine']['when']}" +
             (", compile: true" if results["machine"].get("compile") else "") +
             (" (smoke: toy sizes, not figures)" if results["smoke"] else ""), ""]
    for name, rows in results["sections"].items():
        lines += [f"## {name}", ""]
        rows = rows if isinstance(rows, list) else [rows]
        keys = list(dict.fromkeys(k for r in rows for k in r))
        lines += ["| " + " | ".join(keys) + " |", "| " + " | ".join("---" for _ in keys) + " |"]
        lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_suite"))
    parser.add_argument("--smoke", action="store_true", help="every code path at toy sizes (CPU, seconds)")
    parser.add_argument("--only", nargs="+", help="run only these sections")
    parser.add_argument("--ks", type=lambda text: [int(k) for k in text.split(",")],
                        help="LeNet's numbers of targets solved together, comma-separated (default 1,64,512,4096)")
    parser.add_argument("--compile", action="store_true",
                        help="as audits with compile: true (on CUDA, iterations replayed as CUDA graphs)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else platform.processor() or "cpu"
    results: dict[str, Any] = {"smoke": args.smoke, "sections": {}, "failed": {},
                               "machine": {"device": f"{args.device}: {name}", "torch": torch.__version__,
                                           "python": sys.version.split()[0], "compile": args.compile,
                                           "when": time.strftime("%Y-%m-%d %H:%M:%S")}}
    for section, measure in sections(args.device, args.smoke, args.compile, args.ks).items():
        if args.only and section not in args.only:
            continue
        started = time.perf_counter()
        try:
            results["sections"][section] = measure()
        except Exception as exc:  # the suite goes on: a lent GPU's minutes are few
            results["failed"][section] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        print(f"{section}: {time.perf_counter() - started:.1f} s"
              + (f" FAILED: {results['failed'][section]}" if section in results["failed"] else ""), flush=True)
        (args.out / "gpu_suite.json").write_text(json.dumps(results, indent=1))
        (args.out / "gpu_suite.md").write_text(markdown(results))
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
