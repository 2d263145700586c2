"""The report's figures, drawn with matplotlib (Agg) from the summary and the saved reconstructions."""
from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from leakaudit.evaluator.audit.jobs import AttackJob, job_at
from leakaudit.evaluator.audit.types import params_text, value_text
from leakaudit.evaluator.results.rows import Row
from leakaudit.evaluator.results.rundir import RunFolder
from leakaudit.evaluator.results.summary import second_views
from leakaudit.evaluator.results.types import CellResult, Privacy, Summary, WorstCase, WorstImage
from leakaudit.evaluator.results.verdict import LEAKS, exact_interval, judged_mean
from leakaudit.plugins.manager import Registry


MAX_GRID_IMAGES = 8


def _axis_label(metric: str, higher: bool) -> str:
    return f"{metric.upper()} of the strongest attack ({'higher' if higher else 'lower'}: more leakage)"


def _second_metric(points: list[WorstCase], first: str, registry: Registry) -> str | None:
    """The first of the second views of leakage (``Metric.view_rank``) that the worst cases carry."""
    return next((m for m in second_views(registry) if m != first and any(w.mean(m) is not None for w in points)),
                None)


def _yerr(points: Sequence[CellResult | WorstCase], metric: str) -> np.ndarray | None:
    """Asymmetric error bars from each point's interval (None when a point has none)."""
    bars = [(mean, ci) for w in points if (mean := w.mean(metric)) is not None and (ci := w.ci(metric)) is not None]
    if len(bars) < len(points):
        return None
    return np.array([[mean - ci[0] for mean, ci in bars], [ci[1] - mean for mean, ci in bars]]).clip(min=0)


def _drawn(value: float | None) -> float:
    """A point's accuracy or epsilon where the figure drawing it kept only the points that have one."""
    assert value is not None, "a drawn point has its coordinate"
    return value


def _guarantee(w: WorstCase) -> Privacy:
    """The privacy of a point on the identification figure, which keeps only the settings that have one."""
    assert w.privacy is not None, f"{w.setting}: no privacy guarantee to draw"
    return w.privacy


def _threshold_line(ax, summary: Summary, metric: str) -> None:
    """The leak threshold, with the side beyond it shaded: points there leak."""
    t = summary.leak_threshold
    if t is None or metric != summary.leakage_metric:
        return
    ax.axhline(t.value, color="firebrick", linestyle="--", linewidth=1,
               label=f"leak threshold ({t.guess} guess {'+' if summary.higher_is_more_leakage else '-'} "
                     f"{t.margin:g})")
    ax.axhline(t.guess_score, color="grey", linestyle=":", linewidth=1, label=f"{t.guess} guess")
    low, high = ax.get_ylim()
    if summary.higher_is_more_leakage:
        ax.axhspan(t.value, max(high, t.value), color="firebrick", alpha=0.06)
    else:
        ax.axhspan(min(low, t.value), t.value, color="firebrick", alpha=0.06)


def _chance_line(ax, summary: Summary) -> None:
    """Chance accuracy, and the accuracy a usable model needs, with the unusable side shaded."""
    if summary.chance_accuracy is not None:
        ax.axvline(summary.chance_accuracy, color="black", linestyle="-.", linewidth=1, label="chance accuracy")
    if summary.min_accuracy is not None:
        ax.axvline(summary.min_accuracy, color="darkorange", linestyle="--", linewidth=1, label="usable from")
        left, _ = ax.get_xlim()
        ax.axvspan(min(left, summary.min_accuracy), summary.min_accuracy, color="darkorange", alpha=0.06)


def _style(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _varying(ws: list[WorstCase]) -> list[str]:
    """The parameters that vary along one defense's line (one setting may leave a parameter at its default)."""
    keys = dict.fromkeys(k for x in ws for k in x.params)
    return [k for k in keys if len({str(x.params.get(k)) for x in ws}) > 1]


def _point_text(w: WorstCase, ws: list[WorstCase]) -> str:
    """A point's short label: the values of the parameters that vary (named in the legend), and epsilon."""
    varying = _varying(ws)
    text = ", ".join(value_text(w.params[k]) if k in w.params else "default" for k in varying) if varying \
        else params_text(w.params)
    if w.epsilon is not None and math.isfinite(w.epsilon):
        text += f" (ε {w.epsilon:.2g})"
    return text


def _line_label(defense: str, ws: list[WorstCase]) -> str:
    varying = _varying(ws)
    return f"{defense}: {', '.join(varying)}" if varying else defense


def _mark_leaks(ax, points: list[WorstCase], x: str, y: str) -> None:
    """Ring the points whose verdict is leaks (by score or by identification), so a point under the
    threshold line that leaks by identification is not read as safe."""
    leaking = [w for w in points if w.verdict == LEAKS and w.mean(y) is not None]
    if leaking:
        ax.scatter([getattr(w, x) for w in leaking], [w.mean(y) for w in leaking], s=150, facecolors="none",
                   edgecolors="firebrick", linewidths=1.6, zorder=4, label="verdict: leaks")


def _inside(ax, texts: list) -> None:
    """Labels of points in the right fifth of the axis written to their left, so that none crosses the axis."""
    left, right = ax.get_xlim()
    for text in texts:
        if text.xy[0] > left + 0.8 * (right - left):
            text.set_horizontalalignment("right")
            text.set_position((-5, 2))


def plot_privacy_utility(summary: Summary, path: Path, registry: Registry) -> bool:
    """Accuracy against the strongest attack's leakage (with its interval), one line per defense, beside the
    leak threshold and chance accuracy. False when there is no utility to plot."""
    points = [w for w in summary.worst_case if w.accuracy is not None]
    if not points:
        return False
    first = summary.leakage_metric
    second = _second_metric(points, first, registry)
    panels = [first] + ([second] if second else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), squeeze=False)
    by_defense: dict[str, list[WorstCase]] = defaultdict(list)
    for w in points:
        by_defense[w.defense].append(w)
    for ax, metric in zip(axes[0], panels):
        texts = []
        for defense, ws in by_defense.items():
            ws = sorted((w for w in ws if w.mean(metric) is not None), key=lambda w: _drawn(w.accuracy))
            if not ws:
                continue
            xs, ys = [w.accuracy for w in ws], [w.mean(metric) for w in ws]
            if all(w.baseline for w in ws):  # hollow and on top: a defense's point at the same place shows through
                ax.errorbar(xs, ys, yerr=_yerr(ws, metric), fmt="*", markersize=17, markerfacecolor="none",
                            markeredgewidth=1.6, color="black", zorder=5, label="no defense")
                continue
            ax.errorbar(xs, ys, yerr=_yerr(ws, metric), marker="o", capsize=3, label=_line_label(defense, ws))
            texts += [ax.annotate(_point_text(w, ws), (w.accuracy, w.mean(metric)), fontsize=7,
                                  textcoords="offset points", xytext=(5, 2)) for w in ws]
        _inside(ax, texts)
        _mark_leaks(ax, points, "accuracy", metric)
        _pareto_front(ax, summary, points, metric, registry.get("metric", metric).higher_is_better)
        ax.set_title(f"privacy against utility ({metric})", fontsize=11)
        _threshold_line(ax, summary, metric)
        _chance_line(ax, summary)
        _style(ax, "test accuracy under the defense (utility)", _axis_label(metric, registry.get("metric", metric).higher_is_better))
    _save(fig, path)
    return True


def pareto_front(points: list[WorstCase], metric: str, higher_leaks: bool) -> list[WorstCase]:
    """The defended settings no other beats on both axes (more accurate and leaking less), by accuracy."""
    sign = 1 if higher_leaks else -1
    mine = [w for w in points if not w.baseline and w.mean(metric) is not None]
    return sorted((w for w in mine if not any(
        _drawn(o.accuracy) >= _drawn(w.accuracy) and sign * judged_mean(o, metric) <= sign * judged_mean(w, metric)
        and (o.accuracy, o.mean(metric)) != (w.accuracy, w.mean(metric)) for o in mine)),
        key=lambda w: _drawn(w.accuracy))


def _pareto_front(ax, summary: Summary, points: list[WorstCase], metric: str, higher_leaks: bool) -> None:
    """The Pareto front across every defense, and rings on the frontier searches' weakest protecting settings."""
    front = pareto_front(points, metric, higher_leaks)
    if len(front) > 1:
        ax.plot([w.accuracy for w in front], [w.mean(metric) for w in front], ls="--", color="0.35", lw=1.2,
                zorder=1, label="Pareto front (all defenses)")
    found = {f.protecting_setting for f in summary.frontier if f.protecting_setting}
    ringed = [w for w in points if w.setting in found and w.mean(metric) is not None]
    if ringed:
        ax.scatter([w.accuracy for w in ringed], [w.mean(metric) for w in ringed], s=260, facecolors="none",
                   edgecolors="tab:green", linewidths=2, zorder=6, label="weakest protecting (frontier)")


def _strongest_by_step(summary: Summary) -> dict[str, dict[int, CellResult]]:
    """Per setting and checkpoint: the cell of the most leaking attack."""
    metric, sign = summary.leakage_metric, 1 if summary.higher_is_more_leakage else -1
    best: dict[str, dict[int, CellResult]] = defaultdict(dict)
    for c in summary.cells:
        v = c.mean(metric)
        if v is not None:
            old = best[c.setting].get(c.checkpoint)
            if old is None or sign * v > sign * judged_mean(old, metric):
                best[c.setting][c.checkpoint] = c
    return best


def plot_leakage_by_step(summary: Summary, path: Path, unit: str = "training step") -> bool:
    """The strongest attack's leakage against training step (a federated client's: ``unit`` "round"), with
    intervals, one line per setting; the steps are whole numbers, and so are the ticks."""
    if len(summary.checkpoints) < 2:
        return False
    metric = summary.leakage_metric
    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    for setting, by_step in _strongest_by_step(summary).items():
        cells = [by_step[s] for s in sorted(by_step)]
        ax.errorbar(sorted(by_step), [judged_mean(c, metric) for c in cells], yerr=_yerr(cells, metric), marker="o",
                    capsize=3, label=textwrap.shorten(setting, 40))
    _threshold_line(ax, summary, metric)
    _style(ax, f"{unit} of the attacked model", _axis_label(metric, summary.higher_is_more_leakage))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _save(fig, path)
    return True


def plot_leakage_by_epsilon(summary: Summary, path: Path) -> bool:
    """For defenses with a formal guarantee: leakage and accuracy against epsilon (log scale)."""
    metric = summary.leakage_metric
    points = sorted((w for w in summary.worst_case if w.epsilon is not None
                     and math.isfinite(w.epsilon) and w.mean(metric) is not None), key=lambda w: _drawn(w.epsilon))
    if not points:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.4, 4.6))
    for defense in dict.fromkeys(w.defense for w in points):
        ws = [w for w in points if w.defense == defense]
        xs = [w.epsilon for w in ws]
        left.errorbar(xs, [w.mean(metric) for w in ws], yerr=_yerr(ws, metric), marker="o", capsize=3,
                      label=_line_label(defense, ws))
        if all(w.accuracy is not None for w in ws):
            right.plot(xs, [w.accuracy for w in ws], marker="o", label=defense)
    for w in summary.worst_case:
        if w.baseline and w.mean(metric) is not None:
            left.axhline(w.mean(metric), color="black", linewidth=1, label="no defense")
            if w.accuracy is not None:
                right.axhline(w.accuracy, color="black", linewidth=1, label="no defense")
    _mark_leaks(left, points, "epsilon", metric)
    _threshold_line(left, summary, metric)
    if summary.chance_accuracy is not None:
        right.axhline(summary.chance_accuracy, color="black", linestyle="-.", linewidth=1, label="chance accuracy")
    if summary.min_accuracy is not None:
        right.axhline(summary.min_accuracy, color="darkorange", linestyle="--", linewidth=1, label="usable from")
    for ax in (left, right):
        ax.set_xscale("log")
    delta = _delta(summary)
    xlabel = f"epsilon at delta {delta:g} (log scale)" if delta else "epsilon (log scale)"
    left.set_title("leakage against the privacy guarantee", fontsize=11)
    right.set_title("utility against the privacy guarantee", fontsize=11)
    _style(left, xlabel, _axis_label(metric, summary.higher_is_more_leakage))
    _style(right, xlabel, "test accuracy")
    _save(fig, path)
    return True


def plot_identification_bound(summary: Summary, path: Path) -> bool:
    """For settings with a privacy guarantee: the most identifying attack's share of identified targets (with its
    exact 95% interval) beside the bound the guarantee sets on any attack, against epsilon (or mu)."""
    points = [w for w in summary.worst_case if w.privacy and w.privacy.bound is not None
              and w.privacy.identified is not None]
    by_epsilon = bool(points) and all(_positive(w.epsilon) for w in points)
    x = (lambda w: w.epsilon) if by_epsilon else (lambda w: w.privacy.mu)
    points = [w for w in points if _positive(x(w))]  # a log axis: no infinite, missing or zero guarantee
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for defense in dict.fromkeys(w.defense for w in points):
        ws = sorted((w for w in points if w.defense == defense), key=x)
        kept = [_guarantee(w) for w in ws]
        line = ax.plot([x(w) for w in ws], [_drawn(p.bound) for p in kept], linestyle="--",
                       label=f"{defense}: bound on any attack")[0]
        shares = np.array([p.identified for p in kept])
        n = np.array([p.identified_n for p in kept])
        low, high = exact_interval(np.round(shares * n).astype(int), n, 0.025)  # two-sided 95%
        ax.errorbar([x(w) for w in ws], shares, yerr=[shares - low, high - shares], marker="o", capsize=3,
                    linestyle="none", color=line.get_color(), label=f"{defense}: identified by the attacks")
        bad = [w for w, p in zip(ws, kept) if p.violated]
        if bad:
            ax.scatter([x(w) for w in bad], [_drawn(_guarantee(w).identified) for w in bad], s=160, facecolors="none",
                       edgecolors="red", linewidths=2, zorder=4, label="beyond the bound")
    chance = _guarantee(points[0]).chance
    ax.axhline(chance, color="grey", linestyle=":", linewidth=1, label=f"a guess ({chance:.0%})")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("identification against the bound the guarantee sets", fontsize=11)
    delta = _delta(summary)
    _style(ax, (f"epsilon at delta {delta:g} (log scale)" if delta else "epsilon (log scale)") if by_epsilon
           else "mu of one update (log scale)", "share of targets identified")
    _save(fig, path)
    return True


def _delta(summary: Summary) -> float | None:
    """The delta of the settings' training guarantee (None without one)."""
    first = next(iter(summary.utility.values()), None)
    return None if first is None else first.delta


def _positive(value: float | None) -> bool:
    """Whether a value can sit on a log axis."""
    return value is not None and math.isfinite(value) and value > 0


def _show(ax, img: torch.Tensor) -> None:
    ax.set_xticks([]), ax.set_yticks([])
    arr = img.permute(1, 2, 0).clamp(0, 1).numpy()
    ax.imshow(arr[..., 0] if arr.shape[2] == 1 else arr, cmap="gray", vmin=0, vmax=1)


def _label(text: str, width: int = 24) -> str:
    """A figure label wrapped at spaces and commas, never inside a word."""
    return "\n".join(textwrap.wrap(text.replace(",", ", "), width, break_long_words=False)[:4])


def plot_reconstructions(folder: RunFolder, rows: dict[tuple, Row], metric: str, checkpoint: int,
                         path: Path) -> bool:
    """Originals on top, then one row per (setting, attack) at ``checkpoint``, each image titled with its score. A
    column is one target (by its index in the data): under per-element secure aggregation a sparse setting attacks
    client 1's images alone, so the columns are those of the line with the fewest, each line's own shown there."""
    audit = folder.audit
    lines: list[tuple[str, dict[Any, tuple[torch.Tensor, torch.Tensor, float | None]]]] = []
    for s in audit.settings:
        for a in audit.attacks:
            shown: dict[Any, tuple[torch.Tensor, torch.Tensor, float | None]] = {}
            for t in range(audit.num_batches_of(s)):
                job = AttackJob(s, a, checkpoint, t)
                saved = folder.load_reconstruction(job)
                if saved is None:
                    continue
                n = len(saved["original"])
                row = rows.get(job.key)
                each = row.per_image_of(metric) if row is not None else []
                each = each if len(each) == n else [None] * n
                ids = row.images if row is not None and len(row.images) == n else [(t, i) for i in range(n)]
                shown |= {k: (o, r, v) for k, o, r, v in zip(ids, saved["original"], saved["reconstruction"], each)}
            if shown:
                lines.append((f"{s.key} · {a.key}", shown))
    if not lines:
        return False
    fewest = lines[min(range(len(lines)), key=lambda i: len(lines[i][1]))][1]
    columns = list(fewest)[:MAX_GRID_IMAGES]
    n = len(columns)
    fig, axes = plt.subplots(len(lines) + 1, n, figsize=(1.25 * n + 2.4, 1.45 * (len(lines) + 1)), squeeze=False)
    for j, k in enumerate(columns):
        _show(axes[0][j], next(shown[k][0] for _, shown in lines if k in shown))
    axes[0][0].set_ylabel("original", rotation=0, ha="right", va="center", fontsize=9)
    for i, (label, shown) in enumerate(lines, start=1):
        for j, k in enumerate(columns):
            ax = axes[i][j]
            if k in shown:
                _show(ax, shown[k][1])
                if shown[k][2] is not None:
                    ax.set_title(f"{shown[k][2]:.3g}", fontsize=8, pad=2)
            else:
                ax.axis("off")
        axes[i][0].set_ylabel(_label(label), rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle(f"step {checkpoint}: reconstructions, each titled with its {metric}", fontsize=10)
    _save(fig, path)
    return True


def worst_batches(folder: RunFolder, summary: Summary) -> Iterator[tuple[WorstCase, WorstImage, dict]]:
    """Each setting's most leaking target batch: its worst case, the worst example's place, and the batch as saved
    (originals and aligned reconstructions); settings without one, or whose batch was not kept, left out."""
    for w in summary.worst_case:
        at = w.worst_image
        if at is None:
            continue
        saved = folder.load_reconstruction(job_at(folder.audit, w.setting, at.attack, at.checkpoint, at.target))
        if saved is not None:
            yield w, at, saved


def plot_worst_images(folder: RunFolder, summary: Summary, path: Path) -> bool:
    """Per setting, the single most leaking reconstruction beside its original."""
    shown = [(w, at, saved["original"][at.index], saved["reconstruction"][at.index])
             for w, at, saved in worst_batches(folder, summary)]
    if not shown:
        return False
    fig, axes = plt.subplots(2, len(shown), figsize=(2.3 * len(shown) + 1.2, 4.6), squeeze=False)
    for j, (w, at, orig, rec) in enumerate(shown):
        _show(axes[0][j], orig)
        _show(axes[1][j], rec)
        axes[0][j].set_title(_label(w.setting, 22), fontsize=8)
        axes[1][j].set_xlabel(_label(f"{summary.leakage_metric} {at.score:.3g}, {at.attack}, step {at.checkpoint}",
                                     22), fontsize=8)
    axes[0][0].set_ylabel("original", fontsize=9)
    axes[1][0].set_ylabel("most leaking\nreconstruction", fontsize=9)
    _save(fig, path)
    return True
