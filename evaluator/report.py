"""Reports: summary.json, privacy-utility and leakage plots, reconstruction grids and report.html."""
from __future__ import annotations

import base64
import html
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from leakaudit.evaluator.config import Audit  # noqa: E402

PRIVACY_METRIC = "psnr"
SECOND_METRICS = ("lpips", "ssim")  # the privacy-utility plot's second panel shows the first one measured


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and spread of the finite values (None, NaN and inf are left out; ``summarise`` says so)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.pstdev(vals) if len(vals) > 1 else 0.0)


def summarise(audit: Audit, rows: list[dict], utility: list[dict], notes: list[str]) -> dict[str, Any]:
    """Per-cell means and spreads, and the worst case (most leaking attack and step) of each setting."""
    acc = {u["setting"]: u for u in utility}
    roles = {a.key: a.role for a in audit.attacks}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["setting"], r["attack"], r["checkpoint"])].append(r)
    cells = []
    for (setting, attack, ckpt), rs in groups.items():
        cell = {"defense": rs[0]["defense"], "setting": setting, "params": rs[0]["params"], "attack": attack,
                "role": roles.get(attack, "naive"), "checkpoint": ckpt, "targets": len(rs), "accuracy": acc.get(setting, {}).get("accuracy"),
                "epsilon": acc.get(setting, {}).get("epsilon")}
        for m in audit.metrics:
            cell[f"{m}_mean"], cell[f"{m}_std"] = _mean_std([r.get(m) for r in rs])
            bad = sum(1 for r in rs if r.get(m) is not None and not math.isfinite(r[m]))
            if bad:
                notes.append(f"{setting}, {attack}, step {ckpt}: {bad} of {len(rs)} targets have a non-finite {m} "
                             "(the model or the reconstruction diverged); the cell leaves them out")
        cell["seconds_mean"] = _mean_std([r["seconds"] for r in rs])[0]
        cells.append(cell)
    worst = []
    for s in audit.settings:
        mine = [c for c in cells if c["setting"] == s.key and c.get(f"{PRIVACY_METRIC}_mean") is not None]
        if mine:
            top = max(mine, key=lambda c: c[f"{PRIVACY_METRIC}_mean"])
            worst.append({"defense": s.name, "setting": s.key, "params": s.params, "accuracy": top["accuracy"],
                          "epsilon": top["epsilon"], "attack": top["attack"], "checkpoint": top["checkpoint"],
                          **{m: top.get(f"{m}_mean") for m in (PRIVACY_METRIC, *SECOND_METRICS)
                             if f"{m}_mean" in top}})
    return {"audit": audit.name, "dataset": audit.data["dataset"] or audit.data["factory"], "model": audit.model["name"],
            "device": audit.device, "seed": audit.seed, "metrics": audit.metrics, "checkpoints": audit.checkpoints,
            "utility": {u["setting"]: {k: u.get(k) for k in ("accuracy", "train_steps", "epsilon", "delta",
                                                             "model_changes", "checkpoint_accuracy")}
                        for u in utility},
            "cells": cells, "worst_case": worst, "naive_vs_adaptive": naive_vs_adaptive(cells), "warnings": notes}


def naive_vs_adaptive(cells: list[dict]) -> list[dict[str, Any]]:
    """Per setting and step: the strongest naive and the strongest adaptive attack's mean PSNR, and the gap.

    Only where both kinds ran: the gap is how much safer the defense looks than it is.
    """
    best: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for c in cells:
        v = c.get(f"{PRIVACY_METRIC}_mean")
        if v is None:
            continue
        slot = best[(c["setting"], c["checkpoint"])]
        if c["role"] not in slot or v > slot[c["role"]][f"{PRIVACY_METRIC}_mean"]:
            slot[c["role"]] = c
    out = []
    for (setting, ckpt), slot in best.items():
        if len(slot) == 2:
            naive, adaptive = slot["naive"], slot["adaptive"]
            n, a = naive[f"{PRIVACY_METRIC}_mean"], adaptive[f"{PRIVACY_METRIC}_mean"]
            out.append({"defense": naive["defense"], "setting": setting, "checkpoint": ckpt,
                        "accuracy": naive["accuracy"], "naive_attack": naive["attack"], "naive_psnr": n,
                        "adaptive_attack": adaptive["attack"], "adaptive_psnr": a, "gap_db": a - n})
    return out


def _point_label(params: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _baseline_line(ax, summary: dict) -> None:
    guess = summary.get("baselines", {}).get("random", {}).get(PRIVACY_METRIC)
    if guess is not None:
        ax.axhline(guess, color="grey", linestyle="--", linewidth=1, label="random guess")


def _second_metric(points: list[dict]) -> str | None:
    return next((m for m in SECOND_METRICS if any(w.get(m) is not None for w in points)), None)


def plot_privacy_utility(summary: dict, path: Path) -> bool:
    """Accuracy against the worst-case attack's PSNR (and LPIPS or SSIM), one line per defense.

    Points are labelled with the parameters that vary and, where the defense has a formal
    guarantee, its epsilon. False when there is no utility to plot.
    """
    points = [w for w in summary["worst_case"] if w["accuracy"] is not None]
    if not points:
        return False
    second = _second_metric(points)
    panels = [PRIVACY_METRIC] + ([second] if second else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.4), squeeze=False)
    by_defense: dict[str, list[dict]] = defaultdict(list)
    for w in points:
        by_defense[w["defense"]].append(w)
    for ax, metric in zip(axes[0], panels):
        for defense, ws in by_defense.items():
            ws = sorted((w for w in ws if w.get(metric) is not None), key=lambda w: w["accuracy"])
            xs, ys = [w["accuracy"] for w in ws], [w[metric] for w in ws]
            if defense == "none":
                ax.scatter(xs, ys, marker="*", s=180, color="black", zorder=3, label="no defense")
                continue
            ax.plot(xs, ys, marker="o", label=defense)
            for w in ws:
                ax.annotate(_point_text(w, ws), (w["accuracy"], w[metric]), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
        ax.set_title(f"{summary['audit']}: privacy-utility ({metric})")
        label = {"psnr": "PSNR of the strongest attack, dB (leakage)",
                 "lpips": "LPIPS of the strongest attack (lower: more leakage)",
                 "ssim": "SSIM of the strongest attack (higher: more leakage)"}[metric]
        _style(ax, summary if metric == PRIVACY_METRIC else {}, "test accuracy under the defense (utility)", label)
    _save(fig, path)
    return True


def _point_text(w: dict, ws: list[dict]) -> str:
    """The parameters that vary along the defense's line, and epsilon where there is one."""
    varying = {k for k in w["params"] if len({str(x["params"].get(k)) for x in ws}) > 1}
    shown = {k: v for k, v in w["params"].items() if k in varying} if varying else w["params"]
    text = _point_label(shown)
    if w.get("epsilon") is not None:
        text += f", eps={w['epsilon']:.3g}"
    return text


def _style(ax, summary: dict, xlabel: str, ylabel: str) -> None:
    """Baseline line, labels, grid and legend."""
    _baseline_line(ax, summary)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finish(fig, ax, summary: dict, path: Path, xlabel: str, ylabel: str) -> None:
    """Style one-panel figures, then save and close."""
    _style(ax, summary, xlabel, ylabel)
    _save(fig, path)


def plot_leakage_by_step(summary: dict, path: Path) -> bool:
    """PSNR of the strongest attack against training step, one line per setting."""
    if len(summary["checkpoints"]) < 2:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    best: dict[str, dict[int, float]] = defaultdict(dict)
    for c in summary["cells"]:
        v = c.get(f"{PRIVACY_METRIC}_mean")
        if v is not None:
            best[c["setting"]][c["checkpoint"]] = max(v, best[c["setting"]].get(c["checkpoint"], -1e9))
    for setting, by_step in best.items():
        steps = sorted(by_step)
        ax.plot(steps, [by_step[s] for s in steps], marker="o", label=setting)
    _finish(fig, ax, summary, path, "training step of the attacked model", "PSNR of the strongest attack, dB")
    return True


def plot_reconstructions(audit: Audit, out_dir: Path, path: Path, max_images: int = 8) -> bool:
    """Originals on top, then one row of reconstructions per (setting, attack) at the first checkpoint."""
    from leakaudit.evaluator.runner import AttackJob, recon_file

    ckpt = audit.checkpoints[0]
    rows: list[tuple[str, torch.Tensor]] = []
    originals = None
    for s in audit.settings:
        for a in audit.attacks:
            recs, origs = [], []
            for t in range(audit.num_batches):
                f = recon_file(out_dir, AttackJob(s, a, ckpt, t))
                if f.exists():
                    saved = torch.load(f, weights_only=True)
                    recs.append(saved["reconstruction"])
                    origs.append(saved["original"])
            if recs:
                rows.append((f"{s.key}\n{a.key}", torch.cat(recs)[:max_images]))
                originals = torch.cat(origs)[:max_images] if originals is None else originals
    if originals is None:
        return False
    rows.insert(0, ("original", originals))
    n = len(originals)
    fig, axes = plt.subplots(len(rows), n, figsize=(1.2 * n + 1.6, 1.25 * len(rows)), squeeze=False)
    for i, (label, imgs) in enumerate(rows):
        for j in range(n):
            ax = axes[i][j]
            ax.set_xticks([]), ax.set_yticks([])
            if j < len(imgs):
                img = imgs[j].permute(1, 2, 0).clamp(0, 1).numpy()
                ax.imshow(img[..., 0] if img.shape[2] == 1 else img, cmap="gray", vmin=0, vmax=1)
            if j == 0:
                ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _img_tag(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{path.name}" src="data:image/png;base64,{data}">'


def _table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, dict):
            return html.escape(_point_label(v))
        return html.escape("" if v is None else str(v))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{fmt(r.get(c))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def architecture(audit: Audit) -> list[dict[str, Any]]:
    """``leakaudit analyse``'s result for every model of the audit, or why it does not apply."""
    from leakaudit.evaluator.analysis import analyse_all
    from leakaudit.evaluator.scenario import Scenario

    return analyse_all(Scenario(audit))


def _architecture_html(results: list[dict[str, Any]]) -> str:
    parts = []
    for result in results:
        name = html.escape(result["model"])
        if "not_applicable" in result:
            parts.append(f"<p><b>{name}</b>: not computed: {html.escape(result['not_applicable'])}.</p>")
            continue
        rows = [{**layer, "input_shape": "x".join(map(str, layer["input_shape"]))} for layer in result["layers"]]
        parts.append(f"<p><b>{name}</b>: security metric (seed 002, Definition 3.3) <b>{result['metric']:.1f}</b></p>"
                     + _table(rows, ["layer", "input_shape", "equations", "unknowns", "rank_deficiency"]))
    return "".join(parts) + (
        "<p>Each convolutional layer's input solves a linear system from its forward and backward passes "
        "(one target image, step 0); the rank deficiency is rank minus unknowns, and the metric is their "
        "average weighted towards early layers. 0: every input is determined by the gradients (layer-wise "
        "attacks such as rgap rebuild the image); more negative: more is left undetermined.</p>")


def summarise_tuning(audit: Audit, trials: list[dict]) -> list[dict[str, Any]]:
    """Per (setting, attack, checkpoint): the search's budget, the untuned and the winning score and setting."""
    from leakaudit.evaluator.tuning import winners

    best = winners(trials, audit.registry)
    out = []
    for key, win in best.items():
        mine = [t for t in trials if (t["setting"], t["attack"], t["checkpoint"]) == key]
        untuned = next(t for t in mine if t["trial"] == 0)
        spec = next(a.tune for a in audit.attacks if a.key == key[1])
        changed = {k: v for k, v in win["params"].items() if untuned["params"].get(k) != v}
        out.append({"setting": key[0], "attack": key[1], "checkpoint": key[2], "metric": win["metric"],
                    "budget": spec.budget, "trials": len(mine), "tuning_batches": spec.targets,
                    "untuned": untuned["score"], "tuned": win["score"], "winner": changed or "untuned",
                    "search_seconds": round(sum(t["seconds"] for t in mine), 1)})
    return out


def write_report(audit: Audit, out_dir: Path, rows: list[dict], utility: list[dict], notes: list[str],
                 baselines: dict[str, dict[str, float | None]], tuning: list[dict]) -> dict:
    """Write summary.json, the figures and a self-contained report.html; return the summary."""
    summary = summarise(audit, rows, utility, notes)
    summary["baselines"] = baselines
    summary["tuning"] = summarise_tuning(audit, tuning)
    summary["architecture"] = architecture(audit)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    sections = []
    if notes:
        sections.append(("Warnings", "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>"))
    pu = out_dir / "privacy_utility.png"
    if plot_privacy_utility(summary, pu):
        sections.append(("Privacy against utility", _img_tag(pu) + _table(
            summary["worst_case"], ["defense", "params", "accuracy", "epsilon", "attack", "checkpoint", PRIVACY_METRIC,
                                    *[m for m in SECOND_METRICS if m in audit.metrics]])
            + "<p>Leakage is the mean PSNR of the strongest attack at its most leaking training step. Epsilon, "
              f"where a defense has a formal guarantee, is at delta {audit.utility['delta']:g} after the utility "
              "training's steps at Opacus's sample rate, 1 / ceil(training images / batch size).</p>"))
    else:
        sections.append(("Privacy against utility", "<p>No utility was measured (utility.train_steps is 0).</p>"
                         + _table(summary["worst_case"], ["defense", "params", "attack", PRIVACY_METRIC])))
    if summary["naive_vs_adaptive"]:
        sections.append(("Naive against adaptive attacks", _table(summary["naive_vs_adaptive"], [
            "defense", "setting", "checkpoint", "accuracy", "naive_attack", "naive_psnr", "adaptive_attack",
            "adaptive_psnr", "gap_db"]) + "<p>The strongest attack that ignores the defense (naive) beside the "
            "strongest one that uses what the defense does (adaptive: its likelihood, the tensors it leaves "
            "untouched, the noise it draws). A defense judged by the naive column looks safer than it is by "
            "the gap.</p>"))
    changed = [{"setting": k, "changes": "; ".join(u["model_changes"])} for k, u in summary["utility"].items()
               if u.get("model_changes")]
    if changed:
        sections.append(("Model changes made by defenses", _table(changed, ["setting", "changes"])
                         + "<p>What each defense changed in the model before training and attacks "
                           "(for dpsgd: what Opacus's ModuleValidator fixed).</p>"))
    sections.append(("Architecture: layer-wise linear systems (seed 002)", _architecture_html(summary["architecture"])))
    steps = out_dir / "leakage_by_step.png"
    if plot_leakage_by_step(summary, steps):
        sections.append(("Leakage through training", _img_tag(steps)))
    baseline_rows = [{"guess": name, **values} for name, values in baselines.items()]
    sections.append(("Baselines: guesses without the gradient", _table(baseline_rows, ["guess", *baselines["grey"]])
                     + "<p>An attack leaks only where it beats these.</p>"))
    if summary["tuning"]:
        sections.append(("Adaptive attacker: hyperparameter search", _table(summary["tuning"], [
            "setting", "attack", "checkpoint", "metric", "budget", "trials", "tuning_batches", "untuned", "tuned",
            "winner", "search_seconds"]) + "<p>Each search tries the untuned setting first on tuning images drawn "
            "from the training split (never an attacked target); every target is then attacked with the winner.</p>"))
    metric_cols = [f"{m}_{s}" for m in audit.metrics for s in ("mean", "std")]
    sections.append(("All results (mean over targets)", _table(
        summary["cells"], ["setting", "attack", "checkpoint", "targets", "accuracy", "epsilon", *metric_cols, "seconds_mean"])))
    grid = out_dir / "reconstructions.png"
    if plot_reconstructions(audit, out_dir, grid):
        sections.append((f"Reconstructions at step {audit.checkpoints[0]}", _img_tag(grid)))
    pm = audit.registry.pm
    if pm is not None:
        for extra in pm.hook.report_extras(summary=summary, audit=audit, out_dir=out_dir):
            sections.extend(extra or [])
    sections.append(("Audit file", f"<pre>{html.escape(audit.text)}</pre>"))
    body = "".join(f"<h2>{html.escape(t)}</h2>\n{content}\n" for t, content in sections)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>leakaudit: {html.escape(audit.name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}}
table{{border-collapse:collapse;font-size:13px;margin:1em 0}}td,th{{border:1px solid #ccc;padding:3px 6px}}
th{{background:#f3f3f3}}img{{max-width:100%}}pre{{background:#f7f7f7;padding:1em}}</style></head><body>
<h1>leakaudit: {html.escape(audit.name)}</h1>
<p>Dataset <b>{html.escape(summary['dataset'])}</b>, model <b>{html.escape(audit.model['name'])}</b>,
{audit.data['targets']} target images in batches of {audit.data['batch_size']}, checkpoints {audit.checkpoints},
device {audit.device}, seed {audit.seed}.</p>
{body}</body></html>"""
    (out_dir / "report.html").write_text(page)
    return summary
