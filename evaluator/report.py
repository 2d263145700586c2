"""Reports: summary.json, privacy-utility and leakage plots, reconstruction grids and report.html."""
from __future__ import annotations

import base64
import html
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
from leakaudit.evaluator.rundir import REPORT, SUMMARY, AttackJob, RunFolder  # noqa: E402
from leakaudit.evaluator.tuning import winners  # noqa: E402

SECOND_METRICS = ("lpips", "ssim", "psnr")  # the privacy-utility plot's second panel: the first measured besides


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
    leakage = audit.registry.get("metric", audit.leakage_metric)
    worst = []
    for s in audit.settings:
        mine = [c for c in cells if c["setting"] == s.key and c.get(f"{leakage.name}_mean") is not None]
        if mine:
            top = _strongest(mine, leakage)
            worst.append({"defense": s.name, "setting": s.key, "params": s.params,
                          "baseline": s.is_baseline(audit.registry), "accuracy": top["accuracy"],
                          "epsilon": top["epsilon"], "attack": top["attack"], "checkpoint": top["checkpoint"],
                          **{m: top.get(f"{m}_mean") for m in (leakage.name, *SECOND_METRICS) if f"{m}_mean" in top}})
    return {"audit": audit.name, "leakage_metric": leakage.name, "higher_is_more_leakage": leakage.higher_is_better, "dataset": audit.data["dataset"] or audit.data["factory"], "model": audit.model["name"],
            "device": audit.device, "seed": audit.seed, "metrics": audit.metrics, "checkpoints": audit.checkpoints,
            "utility": {u["setting"]: {k: u.get(k) for k in ("accuracy", "train_steps", "epsilon", "delta",
                                                             "model_changes", "checkpoint_accuracy")}
                        for u in utility},
            "cells": cells, "worst_case": worst, "naive_vs_adaptive": naive_vs_adaptive(cells, leakage),
            "warnings": notes}


def _strongest(cells: list[dict], metric) -> dict:
    """The cell whose mean ``metric`` shows the most leakage."""
    key = f"{metric.name}_mean"
    return max(cells, key=lambda c: c[key]) if metric.higher_is_better else min(cells, key=lambda c: c[key])


def naive_vs_adaptive(cells: list[dict], metric) -> list[dict[str, Any]]:
    """Per setting and step: the strongest naive and the strongest adaptive attack's mean leakage score, and the gap.

    Only where both kinds ran. ``gap`` is in the metric's units, positive when the adaptive attack leaks
    more: how much safer the defense looks than it is.
    """
    key = f"{metric.name}_mean"
    best: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for c in cells:
        if c.get(key) is None:
            continue
        slot = best[(c["setting"], c["checkpoint"])]
        if c["role"] not in slot or metric.better(c[key], slot[c["role"]][key]):
            slot[c["role"]] = c
    out = []
    for (setting, ckpt), slot in best.items():
        if len(slot) == 2:
            naive, adaptive = slot["naive"], slot["adaptive"]
            n, a = naive[key], adaptive[key]
            out.append({"defense": naive["defense"], "setting": setting, "checkpoint": ckpt, "metric": metric.name,
                        "accuracy": naive["accuracy"], "naive_attack": naive["attack"], "naive_score": n,
                        "adaptive_attack": adaptive["attack"], "adaptive_score": a,
                        "gap": (a - n) if metric.higher_is_better else (n - a)})
    return out


def _point_label(params: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _baseline_line(ax, summary: dict) -> None:
    guess = summary.get("baselines", {}).get("random", {}).get(summary.get("leakage_metric"))
    if guess is not None:
        ax.axhline(guess, color="grey", linestyle="--", linewidth=1, label="random guess")


def _second_metric(points: list[dict], first: str) -> str | None:
    return next((m for m in SECOND_METRICS if m != first and any(w.get(m) is not None for w in points)), None)


def _axis_label(metric: str, summary: dict) -> str:
    higher = summary["higher_is_more_leakage"] if metric == summary["leakage_metric"] else metric != "lpips"
    return f"{metric.upper()} of the strongest attack ({'higher' if higher else 'lower'}: more leakage)"


def plot_privacy_utility(summary: dict, path: Path) -> bool:
    """Accuracy against the worst-case attack's leakage score (and LPIPS, SSIM or PSNR), one line per defense.

    Points are labelled with the parameters that vary and, where the defense has a formal
    guarantee, its epsilon. False when there is no utility to plot.
    """
    points = [w for w in summary["worst_case"] if w["accuracy"] is not None]
    if not points:
        return False
    first = summary["leakage_metric"]
    second = _second_metric(points, first)
    panels = [first] + ([second] if second else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.4), squeeze=False)
    by_defense: dict[str, list[dict]] = defaultdict(list)
    for w in points:
        by_defense[w["defense"]].append(w)
    for ax, metric in zip(axes[0], panels):
        for defense, ws in by_defense.items():
            ws = sorted((w for w in ws if w.get(metric) is not None), key=lambda w: w["accuracy"])
            xs, ys = [w["accuracy"] for w in ws], [w[metric] for w in ws]
            if all(w["baseline"] for w in ws):
                ax.scatter(xs, ys, marker="*", s=180, color="black", zorder=3, label="no defense")
                continue
            ax.plot(xs, ys, marker="o", label=defense)
            for w in ws:
                ax.annotate(_point_text(w, ws), (w["accuracy"], w[metric]), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
        ax.set_title(f"{summary['audit']}: privacy-utility ({metric})")
        _style(ax, summary if metric == first else {}, "test accuracy under the defense (utility)",
               _axis_label(metric, summary))
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
    """The strongest attack's leakage score against training step, one line per setting."""
    if len(summary["checkpoints"]) < 2:
        return False
    metric, sign = summary["leakage_metric"], 1 if summary["higher_is_more_leakage"] else -1
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    best: dict[str, dict[int, float]] = defaultdict(dict)
    for c in summary["cells"]:
        v = c.get(f"{metric}_mean")
        if v is not None:
            old = best[c["setting"]].get(c["checkpoint"])
            best[c["setting"]][c["checkpoint"]] = v if old is None or sign * v > sign * old else old
    for setting, by_step in best.items():
        steps = sorted(by_step)
        ax.plot(steps, [by_step[s] for s in steps], marker="o", label=setting)
    _finish(fig, ax, summary, path, "training step of the attacked model", _axis_label(metric, summary))
    return True


def plot_reconstructions(folder: RunFolder, path: Path, max_images: int = 8) -> bool:
    """Originals on top, then one row of reconstructions per (setting, attack) at the first checkpoint."""
    audit = folder.audit
    ckpt = audit.checkpoints[0]
    rows: list[tuple[str, torch.Tensor]] = []
    originals = None
    for s in audit.settings:
        for a in audit.attacks:
            recs, origs = [], []
            for t in range(audit.num_batches):
                saved = folder.load_reconstruction(AttackJob(s, a, ckpt, t))
                if saved is not None:
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



def _architecture_html(results: list[dict[str, Any]]) -> str:
    parts = []
    for result in results:
        name = html.escape(result["model"])
        if "not_applicable" in result:
            parts.append(f"<p><b>{name}</b>: not computed: {html.escape(result['not_applicable'])}.</p>")
            continue
        rows = [{**layer, "input_shape": "x".join(map(str, layer["input_shape"]))} for layer in result["layers"]]
        parts.append(f"<p><b>{name}</b>: security metric (Chen & Campbell 2022, Definition 3.3) <b>{result['metric']:.1f}</b></p>"
                     + _table(rows, ["layer", "input_shape", "equations", "unknowns", "rank_deficiency"]))
    return "".join(parts) + (
        "<p>Each convolutional layer's input solves a linear system from its forward and backward passes "
        "(one target image, step 0); the rank deficiency is rank minus unknowns, and the metric is their "
        "average weighted towards early layers. 0: every input is determined by the gradients (layer-wise "
        "attacks such as rgap rebuild the image); more negative: more is left undetermined.</p>")


def summarise_tuning(audit: Audit, trials: list[dict]) -> list[dict[str, Any]]:
    """Per (setting, attack, checkpoint): the search's budget, the untuned and the winning score and setting."""
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


def write_report(folder: RunFolder, rows: list[dict], utility: list[dict], notes: list[str],
                 baselines: dict[str, dict[str, float | None]], tuning: list[dict],
                 architecture: list[dict[str, Any]]) -> dict:
    """Write summary.json, the figures and a self-contained report.html; return the summary.

    Everything it shows was computed during the run (rows, utility, baselines, the architecture
    analysis), so writing the report does no attack or analysis work of its own.
    """
    audit, out_dir = folder.audit, folder.path
    summary = summarise(audit, rows, utility, notes)
    summary["baselines"] = baselines
    summary["tuning"] = summarise_tuning(audit, tuning)
    summary["architecture"] = architecture
    folder.write_json(SUMMARY, summary)
    leak = summary["leakage_metric"]
    sections = []
    if notes:
        sections.append(("Warnings", "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>"))
    pu = out_dir / "privacy_utility.png"
    if plot_privacy_utility(summary, pu):
        sections.append(("Privacy against utility", _img_tag(pu) + _table(
            summary["worst_case"], ["defense", "params", "accuracy", "epsilon", "attack", "checkpoint", leak,
                                    *[m for m in SECOND_METRICS if m in audit.metrics and m != leak]])
            + f"<p>Leakage is the mean {leak} of the strongest attack at its most leaking training step. Epsilon, "
              f"where a defense has a formal guarantee, is at delta {audit.utility['delta']:g} after the utility "
              "training's steps at Opacus's sample rate, 1 / ceil(training images / batch size).</p>"))
    else:
        why = ("utility.train_steps is 0" if audit.utility["train_steps"] == 0
               else f"no setting has a finite {leak} score")
        sections.append(("Privacy against utility", f"<p>No privacy-utility plot: {why}.</p>"
                         + _table(summary["worst_case"], ["defense", "params", "attack", leak])))
    if summary["naive_vs_adaptive"]:
        sections.append(("Naive against adaptive attacks", _table(summary["naive_vs_adaptive"], [
            "defense", "setting", "checkpoint", "accuracy", "naive_attack", "naive_score", "adaptive_attack",
            "adaptive_score", "gap"]) + f"<p>Scores are mean {leak}; the gap is positive where the adaptive attack "
            "leaks more. The strongest attack that ignores the defense (naive) beside the "
            "strongest one that uses what the defense does (adaptive: its likelihood, the tensors it leaves "
            "untouched, the noise it draws). A defense judged by the naive column looks safer than it is by "
            "the gap.</p>"))
    changed = [{"setting": k, "changes": "; ".join(u["model_changes"])} for k, u in summary["utility"].items()
               if u.get("model_changes")]
    if changed:
        sections.append(("Model changes made by defenses", _table(changed, ["setting", "changes"])
                         + "<p>What each defense changed in the model before training and attacks "
                           "(for dpsgd: what Opacus's ModuleValidator fixed).</p>"))
    sections.append(("Architecture: layer-wise linear systems (Chen & Campbell 2022)", _architecture_html(summary["architecture"])))
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
    if plot_reconstructions(folder, grid):
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
    folder.write_text(REPORT, page)
    return summary
