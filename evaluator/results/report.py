"""Reports: summary.json with verdicts and intervals, the figures, and report.html rendered from a template.

Everything shown was computed during the run (rows, utility, baselines, the architecture analysis,
the run's provenance), so ``leakaudit report DIR`` writes the same report again without an attack.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import jinja2
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from leakaudit.evaluator.audit.types import Audit  # noqa: E402
from leakaudit.evaluator.audit.jobs import AttackJob, row_key  # noqa: E402
from leakaudit.evaluator.results.rundir import RunFolder, IDENTIFIABLE, REPORT, SUMMARY  # noqa: E402
from leakaudit.evaluator.audit.tuning import grid_positions, position, scan_best, value_at, winners  # noqa: E402
from leakaudit.evaluator.results.verdict import (  # noqa: E402
    LEAKS,
    STILL_IMPROVING,
    beats_bound,
    calibrate,
    cell_statistics,
    exact_interval,
    finite,
    identifiable_share,
    identification_bound,
    judge,
    leak_threshold,
    min_accuracy,
    named_share,
    overall,
    strongest,
    training_bound,
)

SECOND_METRICS = ("lpips", "ssim", "psnr")  # the privacy-utility plot's second panel: the first measured besides
TEMPLATES = Path(__file__).parent / "templates"
TEMPLATE = "report.html.j2"
MAX_GRID_IMAGES = 8


# --- the summary -------------------------------------------------------------------------------

def _per_image(row: dict, metric: str) -> list[float | None]:
    """A row's per-image scores of ``metric`` (a row from before per-image scores: its batch mean)."""
    return row.get("per_image", {}).get(metric) or [row.get(metric)]


def _worst_image(rows: list[dict], metric) -> dict[str, Any] | None:
    """The single most leaking image of ``rows``: its attack, step, score, target batch and place in the batch
    (None for rows without per-image scores: a label metric, or rows written before they were kept)."""
    best = None
    for r in rows:
        for i, v in enumerate(r.get("per_image", {}).get(metric.name, [])):
            if v is not None and math.isfinite(v) and (best is None or metric.better(v, best["score"])):
                best = {"attack": r["attack"], "checkpoint": r["checkpoint"], "score": v, "target": r["target"],
                        "index": i, "image": r["images"][i] if "images" in r and i < len(r["images"]) else None}
    return best


def summarise(audit: Audit, rows: list[dict], utility: list[dict], notes: list[str],
              baselines: dict[str, dict[str, float | None]] | None = None, run_info: dict[str, Any] | None = None,
              identifiable: tuple[str, dict[tuple, list | None]] | None = None) -> dict[str, Any]:
    """Per-cell means with bootstrap intervals, the strongest attack and the verdict of each setting, each step's
    verdict calibrated by its model's undefended reference, and identification held to any privacy bound."""
    baselines, run_info = baselines or {}, run_info or {}
    identified_by, identified = identifiable or (None, {})
    # matching reconstructions to originals within a batch favours their own: no 1-in-N test at batches > 1
    options = {**audit.verdict, "batch_size": audit.data["batch_size"],
               **({"identifiable": None} if audit.data["batch_size"] > 1 else {}),
               **({"no_utility": "a monitored training measures no test accuracy"} if audit.live else {})}
    acc = {u["setting"]: u for u in utility}
    leakage = audit.registry.get("metric", audit.leakage_metric)
    profiles = {s.key: s.build(audit.registry).privacy_profile() for s in audit.settings}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["setting"], r["attack"], r["checkpoint"])].append(r)
    cells = [_cell(audit, key, rs, acc, options, notes, leakage, identified.get(key) or (None, None), identified_by,
                   profiles.get(key[0])) for key, rs in groups.items()]
    threshold = leak_threshold(baselines, leakage, options["margin"])
    chance = run_info.get("chance_accuracy")
    needed = min_accuracy(options, chance)
    bars = (leakage, threshold, needed, chance, options)
    alone = {s.key: _judged_steps(audit, s, cells, acc, bars) for s in audit.settings}
    verdicts, worst_case = [], []
    for s in audit.settings:
        mine = [c for c in cells if c["setting"] == s.key and c.get(f"{leakage.name}_mean") is not None]
        if not mine:
            if any(c["setting"] == s.key for c in cells):  # attacked, but no finite score: say so, never drop it
                worst_case.append(_unjudged(s, audit, acc.get(s.key, {}), leakage.name))
            continue
        reference = audit.reference_of(s)
        # the reference judged on the attacks that ran on this setting: a weak attack's "protects" is not vouched
        # for by a stronger attack that ran elsewhere
        by_step = {} if reference is None else alone[s.key] if reference is s else _judged_steps(
            audit, reference, cells, acc, bars, {a.key for a in audit.attacks if a.applies_to(s)})
        by_step = {v["checkpoint"]: v for v in by_step}
        per_step = [calibrate(v, by_step.get(v["checkpoint"])) for v in alone[s.key]]
        verdicts.extend(per_step)
        worst_case.append(_worst_case(s, audit, mine, rows, leakage, overall(per_step), profiles[s.key],
                                      acc.get(s.key, {})))
    violations = [f"{c['setting']}, {c['attack']}, step {c['checkpoint']}: {c['bound_violated']}"
                  for c in cells if c.get("bound_violated")]
    return {"audit": audit.name, "leakage_metric": leakage.name, "higher_is_more_leakage": leakage.higher_is_better,
            "dataset": audit.data["dataset"] or audit.data["factory"], "model": audit.model["name"],
            "device": audit.device, "seed": audit.seed, "metrics": audit.metrics, "checkpoints": audit.checkpoints,
            "verdict_options": audit.verdict, "leak_threshold": threshold, "chance_accuracy": chance,
            "min_accuracy": needed, "identifiable_by": identified_by,
            "utility": {u["setting"]: {k: u.get(k) for k in ("accuracy", "train_steps", "epsilon", "delta",
                                                             "model_changes", "checkpoint_accuracy")}
                        for u in utility},
            "cells": cells, "worst_case": worst_case, "verdicts": verdicts, "bound_violations": violations,
            "naive_vs_adaptive": naive_vs_adaptive(cells, leakage), "warnings": notes}


def _judged_steps(audit: Audit, setting, cells: list[dict], acc: dict, bars: tuple,
                  attacks: set[str] | None = None) -> list[dict]:
    """A setting's verdict, judged alone, at each step it has a finite score, from its cells (those of
    ``attacks`` only, where given); ``bars``: the leakage metric, leak threshold, usable accuracy, chance and the
    verdict options."""
    leakage, threshold, needed, chance, options = bars
    mine = [c for c in cells if c["setting"] == setting.key and (attacks is None or c["attack"] in attacks)
            and c.get(f"{leakage.name}_mean") is not None]
    accuracy = acc.get(setting.key, {}).get("accuracy")
    return [{"setting": setting.key, "defense": setting.name, "checkpoint": ckpt, **judge(
        [c for c in mine if c["checkpoint"] == ckpt], leakage, threshold, accuracy, needed, chance, options)}
        for ckpt in audit.checkpoints if any(c["checkpoint"] == ckpt for c in mine)]


def _cell(audit: Audit, key: tuple, rs: list[dict], acc: dict, options: dict, notes: list[str], leakage,
          identified: tuple[float | None, float | None], identified_by: str | None, profile) -> dict[str, Any]:
    """One (setting, attack, checkpoint)'s statistics over its rows: per metric mean, std, interval and count;
    its most leaking image; its identifiable share and the bound a privacy guarantee sets on it; convergence."""
    setting, attack, ckpt = key
    roles = {a.key: a.role for a in audit.attacks}
    cell = {"defense": rs[0]["defense"], "setting": setting, "params": rs[0]["params"], "attack": attack,
            "role": roles.get(attack, "naive"), "checkpoint": ckpt, "targets": len(rs),
            "accuracy": acc.get(setting, {}).get("accuracy"), "epsilon": acc.get(setting, {}).get("epsilon")}
    for m in audit.metrics:
        values = [v for r in rs for v in _per_image(r, m)]
        cell.update(cell_statistics(values, m, key, audit.seed, options["confidence"], options["bootstrap"]))
        bad = sum(1 for v in values if v is not None and not math.isfinite(v))
        if bad:
            notes.append(f"{setting}, {attack}, step {ckpt}: {bad} of {len(values)} images have a non-finite {m} "
                         "(the model or the reconstruction diverged); the cell leaves them out")
    cell["worst_image"] = _worst_image(rs, leakage)
    n, batch = len(rs) * audit.data["batch_size"], audit.data["batch_size"]
    (cell["identifiable"], cell["named"]), cell["identifiable_by"], cell["identifiable_n"] = identified, \
        identified_by, n
    cell["rero_bound"] = identification_bound(profile, batch, n)
    cell["bound_violated"] = beats_bound(cell["named"], n, cell["rero_bound"], options["confidence"])
    gains = finite(r.get("late_gain") for r in rs)
    cell["late_gain"] = float(np.mean(gains)) if gains else None
    cell["still_improving"] = None if not gains else cell["late_gain"] > STILL_IMPROVING
    cell["iterations"] = _iterations(audit, attack, rs)
    cell["seconds_mean"] = float(np.mean([r["seconds"] for r in rs]))
    return cell


def _iterations(audit: Audit, attack: str, rows: list[dict]) -> int | None:
    """The iterations an attack ran with in these rows (its tuned, else configured, else default), if it has any."""
    spec = next((a for a in audit.attacks if a.key == attack), None)
    params = rows[0].get("attack_params") or (spec.params if spec is not None else {})
    if "iterations" in params:
        return params["iterations"]
    declared = audit.registry.get("attack", spec.name).params.get("iterations") if spec is not None else None
    return None if declared is None else declared.default


def _worst_case(s, audit: Audit, mine: list[dict], rows: list[dict], leakage, final: dict, profile,
                utility: dict) -> dict[str, Any]:
    """A setting's entry in the summary's worst case: its strongest attack, its verdict over the steps, and
    where it has a privacy guarantee the bound beside the measured identification."""
    top, _ = strongest(mine, leakage)
    return {
        "defense": s.name, "setting": s.key, "params": s.params, "baseline": s.is_baseline(audit.registry),
        "reference": s.calibrates is not None, "added": s.added,
        "must_protect": s.must_protect, "accuracy": top["accuracy"], "epsilon": top["epsilon"],
        "identifiable": top["identifiable"],
        "attack": top["attack"], "checkpoint": top["checkpoint"],
        **{m: top.get(f"{m}_mean") for m in (leakage.name, *SECOND_METRICS) if f"{m}_mean" in top},
        **{f"{m}_ci": top.get(f"{m}_ci") for m in (leakage.name, *SECOND_METRICS) if f"{m}_ci" in top},
        "n": top[f"{leakage.name}_n"], "verdict": final["verdict"], "reason": final["reason"],
        "verdict_checkpoint": final["checkpoint"], "still_improving": final.get("still_improving"),
        "settling_iterations": final.get("settling_iterations"),
        "privacy": _privacy(profile, mine, audit.data["batch_size"], utility),
        "worst_image": _worst_image([r for r in rows if r["setting"] == s.key], leakage) or {}}


def _privacy(profile, mine: list[dict], batch: int, utility: dict) -> dict[str, Any] | None:
    """A guaranteed setting's privacy beside its attacks: mu, the bound on naming targets, the most any of its
    attacks named (and whether some cell beat the bound), and what the training's epsilon bounds."""
    if profile is None:
        return None
    top = max(mine, key=lambda c: -1 if c.get("named") is None else c["named"])
    chance = batch / top["identifiable_n"]
    return {"mu": profile.mu, "mechanism": profile.mechanism, "bound": top["rero_bound"],
            "identified": top.get("named"), "identified_by": top["attack"], "identified_n": top["identifiable_n"],
            "chance": chance, "violated": any(bool(c.get("bound_violated")) for c in mine),
            "training_bound": training_bound(utility.get("epsilon"), utility.get("delta"), chance)}


def _unjudged(setting, audit: Audit, utility: dict, metric: str) -> dict[str, Any]:
    """The worst-case entry of a setting whose every reconstruction scored no finite ``metric``."""
    return {"defense": setting.name, "setting": setting.key, "params": setting.params,
            "baseline": setting.is_baseline(audit.registry), "reference": setting.calibrates is not None,
            "added": setting.added, "must_protect": setting.must_protect, "privacy": None,
            "accuracy": utility.get("accuracy"), "epsilon": utility.get("epsilon"), "identifiable": None,
            "attack": None, "checkpoint": None, metric: None, f"{metric}_ci": None, "n": 0, "verdict": None,
            "reason": f"not judged: no attack scored a finite {metric} (every reconstruction diverged, or the metric "
                      "could not be computed; see the warnings)", "verdict_checkpoint": None, "worst_image": {}}


def naive_vs_adaptive(cells: list[dict], metric) -> list[dict[str, Any]]:
    """Per setting and step: the strongest naive and the strongest adaptive attack's mean leakage score, and the gap.

    Only where both kinds ran. ``gap`` is in the metric's units, positive when the adaptive attack leaks
    more: how much safer the defense looks than it is; negative when the adaptive attack did worse.
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


def summarise_tuning(audit: Audit, trials: list[dict], notes: list[str]) -> list[dict[str, Any]]:
    """Per (setting, attack, checkpoint): the search's budget, the untuned and the winning score and setting,
    and where the winner sits on each grid (a scan's best on the scan's own range); a winner on a grid's edge
    adds a warning to ``notes``."""
    best = winners(trials, audit.registry)
    out = []
    for key, win in best.items():
        mine = [t for t in trials if (t["setting"], t["attack"], t["checkpoint"]) == key]
        untuned = next(t for t in mine if t["trial"] == 0)
        spec = next(a.tune for a in audit.attacks if a.key == key[1])
        changed = {k: v for k, v in win["params"].items() if untuned["params"].get(k) != v}
        where = f"{key[0]}, {key[1]}, step {key[2]}"
        scanned = scan_best(spec, mine, sum(t.get("stage") == "scan" for t in mine), audit.registry) \
            if spec.scan else None
        space = spec.space_after(scanned)
        positions = grid_positions(space, win["params"]) if win["trial"] != 0 else {}
        for name, place in positions.items():
            if place in ("lowest", "highest"):
                notes.append(f"{where}: the tuned {name}={value_at(win['params'], name)} is the {place} value "
                             f"of its grid {space[name]}; the best may lie beyond it: widen the grid")
        if spec.scan:
            name, place = spec.scan.param, position(spec.scan.values(), scanned)
            if place in ("lowest", "highest"):
                notes.append(f"{where}: the scan's best {name}={scanned} is the {place} value of its scan "
                             f"{spec.scan.low:g}..{spec.scan.high:g}; the best may lie beyond it: widen the scan")
            positions = {f"scan {name}": f"{scanned:g} ({'untuned' if place == 'off the grid' else place})",
                         **positions}
        out.append({"setting": key[0], "attack": key[1], "checkpoint": key[2], "metric": win["metric"],
                    "budget": spec.budget, "trials": len(mine), "tuning_batches": spec.targets,
                    "untuned": untuned["score"], "tuned": win["score"], "winner": changed or "untuned",
                    "on_grid": "; ".join(f"{k}: {v}" for k, v in positions.items()) or "untuned won",
                    "search_seconds": round(sum(t["seconds"] for t in mine), 1)})
    return out


# --- identifiability ---------------------------------------------------------------------------

def _job(audit: Audit, setting: str, attack: str, checkpoint: int, target: int) -> AttackJob:
    """The attack job of a results row's key, to find its saved reconstruction."""
    return AttackJob(next(s for s in audit.settings if s.key == setting),
                     next(a for a in audit.attacks if a.key == attack), checkpoint, target)


def _cell_images(folder: RunFolder, key: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cell's reconstructions and originals over all its target batches (None when one is missing)."""
    recs, origs = [], []
    for t in range(folder.audit.num_batches):
        saved = folder.load_reconstruction(_job(folder.audit, *key, t))
        if saved is None:
            return None
        recs.append(saved["reconstruction"].float())
        origs.append(saved["original"].float())
    return torch.cat(recs), torch.cat(origs)


def _distances(metric, recs: torch.Tensor, origs: torch.Tensor, chunk: int = 512) -> np.ndarray:
    """Distance of every reconstruction (rows) to every original (columns), lower meaning closer."""
    n = len(recs)
    pairs = torch.arange(n * n)
    values = torch.cat([metric.fn(recs[idx // n], origs[idx % n]).detach().cpu()
                        for idx in pairs.split(chunk)])  # n^2 pairs, built a chunk at a time
    d = values.view(n, n).double().numpy()
    return -d if metric.higher_is_better else d


def identifiability(folder: RunFolder, rows: list[dict]) -> tuple[str, dict[tuple, list | None]]:
    """Per cell, the share of reconstructions whose nearest original among the audit's targets is their own
    (after matching each to an original of its update), and the share of targets named from the reconstructions
    alone (``named_share``), by LPIPS where the audit measures it and MSE otherwise; cached in the run folder."""
    audit = folder.audit
    by = "lpips" if "lpips" in audit.metrics and any(r.get("lpips") is not None for r in rows) else "mse"
    metric = audit.registry.get("metric", by)
    cache = folder.read_json(IDENTIFIABLE) or {}
    counts: dict[tuple, int] = defaultdict(int)
    for r in rows:
        counts[(r["setting"], r["attack"], r["checkpoint"])] += 1
    out, changed = {}, False
    for key, n in counts.items():
        name = json.dumps([*key, n, by, "named"])
        if name not in cache:
            images = _cell_images(folder, key)
            distances = None if images is None or audit.data["targets"] < 2 else _distances(metric, *images)
            cache[name] = None if distances is None else [identifiable_share(distances),
                                                          named_share(distances, audit.data["batch_size"])]
            changed = True
        out[key] = cache[name]
    if changed:
        folder.write_json(IDENTIFIABLE, cache)
    return by, out


# --- figures -------------------------------------------------------------------------------------

def _axis_label(metric: str, summary: dict) -> str:
    higher = summary["higher_is_more_leakage"] if metric == summary["leakage_metric"] else metric != "lpips"
    return f"{metric.upper()} of the strongest attack ({'higher' if higher else 'lower'}: more leakage)"


def _second_metric(points: list[dict], first: str) -> str | None:
    return next((m for m in SECOND_METRICS if m != first and any(w.get(m) is not None for w in points)), None)


def _yerr(points: list[dict], metric: str) -> np.ndarray | None:
    """Asymmetric error bars from each point's interval (None when a point has none)."""
    cis = [w.get(f"{metric}_ci") for w in points]
    if any(ci is None for ci in cis):
        return None
    return np.array([[w[metric] - ci[0] for w, ci in zip(points, cis)],
                     [ci[1] - w[metric] for w, ci in zip(points, cis)]]).clip(min=0)


def _threshold_line(ax, summary: dict, metric: str) -> None:
    """The leak threshold, with the side beyond it shaded: points there leak."""
    t = summary.get("leak_threshold")
    if t is None or metric != summary["leakage_metric"]:
        return
    ax.axhline(t["value"], color="firebrick", linestyle="--", linewidth=1,
               label=f"leak threshold ({t['guess']} guess {'+' if summary['higher_is_more_leakage'] else '-'} "
                     f"{t['margin']:g})")
    ax.axhline(t["guess_score"], color="grey", linestyle=":", linewidth=1, label=f"{t['guess']} guess")
    low, high = ax.get_ylim()
    if summary["higher_is_more_leakage"]:
        ax.axhspan(t["value"], max(high, t["value"]), color="firebrick", alpha=0.06)
    else:
        ax.axhspan(min(low, t["value"]), t["value"], color="firebrick", alpha=0.06)


def _chance_line(ax, summary: dict) -> None:
    """Chance accuracy, and the accuracy a usable model needs, with the unusable side shaded."""
    if summary.get("chance_accuracy") is not None:
        ax.axvline(summary["chance_accuracy"], color="black", linestyle="-.", linewidth=1, label="chance accuracy")
    if summary.get("min_accuracy") is not None:
        ax.axvline(summary["min_accuracy"], color="darkorange", linestyle="--", linewidth=1, label="usable from")
        left, _ = ax.get_xlim()
        ax.axvspan(min(left, summary["min_accuracy"]), summary["min_accuracy"], color="darkorange", alpha=0.06)


def _style(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _varying(ws: list[dict]) -> list[str]:
    """The parameters that vary along one defense's line."""
    return [k for k in ws[0]["params"] if len({str(x["params"].get(k)) for x in ws}) > 1]


def _point_text(w: dict, ws: list[dict]) -> str:
    """A point's short label: the values of the parameters that vary (named in the legend), and epsilon."""
    varying = _varying(ws)
    text = ", ".join(f"{w['params'][k]:g}" if isinstance(w["params"][k], float) else str(w["params"][k])
                     for k in varying) if varying else params_text(w["params"])
    if w.get("epsilon") is not None and math.isfinite(w["epsilon"]):
        text += f" (ε {w['epsilon']:.2g})"
    return text


def _line_label(defense: str, ws: list[dict]) -> str:
    varying = _varying(ws)
    return f"{defense}: {', '.join(varying)}" if varying else defense


def _mark_leaks(ax, points: list[dict], x: str, y: str) -> None:
    """Ring the points whose verdict is leaks (by score or by identification), so a point under the
    threshold line that leaks by identification is not read as safe."""
    leaking = [w for w in points if w.get("verdict") == LEAKS and w.get(y) is not None]
    if leaking:
        ax.scatter([w[x] for w in leaking], [w[y] for w in leaking], s=150, facecolors="none",
                   edgecolors="firebrick", linewidths=1.6, zorder=4, label="verdict: leaks")


def plot_privacy_utility(summary: dict, path: Path) -> bool:
    """Accuracy against the strongest attack's leakage (with its interval), one line per defense, beside the
    leak threshold and chance accuracy. False when there is no utility to plot."""
    points = [w for w in summary["worst_case"] if w["accuracy"] is not None]
    if not points:
        return False
    first = summary["leakage_metric"]
    second = _second_metric(points, first)
    panels = [first] + ([second] if second else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), squeeze=False)
    by_defense: dict[str, list[dict]] = defaultdict(list)
    for w in points:
        by_defense[w["defense"]].append(w)
    for ax, metric in zip(axes[0], panels):
        for defense, ws in by_defense.items():
            ws = sorted((w for w in ws if w.get(metric) is not None), key=lambda w: w["accuracy"])
            if not ws:
                continue
            xs, ys = [w["accuracy"] for w in ws], [w[metric] for w in ws]
            if all(w["baseline"] for w in ws):  # hollow and beneath: a defense's point at the same place shows
                ax.errorbar(xs, ys, yerr=_yerr(ws, metric), fmt="*", markersize=15, markerfacecolor="none",
                            color="black", zorder=1, label="no defense")
                continue
            ax.errorbar(xs, ys, yerr=_yerr(ws, metric), marker="o", capsize=3, label=_line_label(defense, ws))
            for w in ws:
                ax.annotate(_point_text(w, ws), (w["accuracy"], w[metric]), fontsize=7,
                            textcoords="offset points", xytext=(5, 2))
        _mark_leaks(ax, points, "accuracy", metric)
        ax.set_title(f"privacy against utility ({metric})", fontsize=11)
        _threshold_line(ax, summary, metric)
        _chance_line(ax, summary)
        _style(ax, "test accuracy under the defense (utility)", _axis_label(metric, summary))
    _save(fig, path)
    return True


def _strongest_by(summary: dict, key: str) -> dict[str, dict[Any, dict]]:
    """Per setting and ``key`` (checkpoint): the cell of the most leaking attack."""
    metric, sign = summary["leakage_metric"], 1 if summary["higher_is_more_leakage"] else -1
    best: dict[str, dict[Any, dict]] = defaultdict(dict)
    for c in summary["cells"]:
        v = c.get(f"{metric}_mean")
        if v is not None:
            old = best[c["setting"]].get(c[key])
            if old is None or sign * v > sign * old[f"{metric}_mean"]:
                best[c["setting"]][c[key]] = c
    return best


def plot_leakage_by_step(summary: dict, path: Path) -> bool:
    """The strongest attack's leakage against training step, with intervals, one line per setting."""
    if len(summary["checkpoints"]) < 2:
        return False
    metric = summary["leakage_metric"]
    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    for setting, by_step in _strongest_by(summary, "checkpoint").items():
        cells = [by_step[s] for s in sorted(by_step)]
        points = [{metric: c[f"{metric}_mean"], f"{metric}_ci": c[f"{metric}_ci"]} for c in cells]
        ax.errorbar(sorted(by_step), [p[metric] for p in points], yerr=_yerr(points, metric), marker="o",
                    capsize=3, label=textwrap.shorten(setting, 40))
    _threshold_line(ax, summary, metric)
    _style(ax, "training step of the attacked model", _axis_label(metric, summary))
    _save(fig, path)
    return True


def plot_leakage_by_epsilon(summary: dict, path: Path) -> bool:
    """For defenses with a formal guarantee: leakage and accuracy against epsilon (log scale)."""
    metric = summary["leakage_metric"]
    points = sorted((w for w in summary["worst_case"] if w.get("epsilon") is not None
                     and math.isfinite(w["epsilon"]) and w.get(metric) is not None), key=lambda w: w["epsilon"])
    if not points:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.4, 4.6))
    for defense in dict.fromkeys(w["defense"] for w in points):
        ws = [w for w in points if w["defense"] == defense]
        xs = [w["epsilon"] for w in ws]
        left.errorbar(xs, [w[metric] for w in ws], yerr=_yerr(ws, metric), marker="o", capsize=3,
                      label=_line_label(defense, ws))
        if all(w["accuracy"] is not None for w in ws):
            right.plot(xs, [w["accuracy"] for w in ws], marker="o", label=defense)
    for w in summary["worst_case"]:
        if w["baseline"] and w.get(metric) is not None:
            left.axhline(w[metric], color="black", linewidth=1, label="no defense")
            if w["accuracy"] is not None:
                right.axhline(w["accuracy"], color="black", linewidth=1, label="no defense")
    _mark_leaks(left, points, "epsilon", metric)
    _threshold_line(left, summary, metric)
    if summary.get("chance_accuracy") is not None:
        right.axhline(summary["chance_accuracy"], color="black", linestyle="-.", linewidth=1, label="chance accuracy")
    if summary.get("min_accuracy") is not None:
        right.axhline(summary["min_accuracy"], color="darkorange", linestyle="--", linewidth=1, label="usable from")
    for ax in (left, right):
        ax.set_xscale("log")
    delta = next(iter(summary["utility"].values()), {}).get("delta")
    xlabel = f"epsilon at delta {delta:g} (log scale)" if delta else "epsilon (log scale)"
    left.set_title("leakage against the privacy guarantee", fontsize=11)
    right.set_title("utility against the privacy guarantee", fontsize=11)
    _style(left, xlabel, _axis_label(metric, summary))
    _style(right, xlabel, "test accuracy")
    _save(fig, path)
    return True


def plot_identification_bound(summary: dict, path: Path) -> bool:
    """For settings with a privacy guarantee: the most identifying attack's share of identified targets (with its
    exact 95% interval) beside the bound the guarantee sets on any attack, against epsilon (or mu)."""
    points = [w for w in summary["worst_case"] if w.get("privacy") and w["privacy"]["bound"] is not None
              and w["privacy"]["identified"] is not None]
    by_epsilon = bool(points) and all(_positive(w.get("epsilon")) for w in points)
    x = (lambda w: w["epsilon"]) if by_epsilon else (lambda w: w["privacy"]["mu"])
    points = [w for w in points if _positive(x(w))]  # a log axis: no infinite, missing or zero guarantee
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for defense in dict.fromkeys(w["defense"] for w in points):
        ws = sorted((w for w in points if w["defense"] == defense), key=x)
        line = ax.plot([x(w) for w in ws], [w["privacy"]["bound"] for w in ws], linestyle="--",
                       label=f"{defense}: bound on any attack")[0]
        shares = np.array([w["privacy"]["identified"] for w in ws])
        n = np.array([w["privacy"]["identified_n"] for w in ws])
        low, high = exact_interval(np.round(shares * n).astype(int), n, 0.025)  # two-sided 95%
        ax.errorbar([x(w) for w in ws], shares, yerr=[shares - low, high - shares], marker="o", capsize=3,
                    linestyle="none", color=line.get_color(), label=f"{defense}: identified by the attacks")
        bad = [w for w in ws if w["privacy"]["violated"]]
        if bad:
            ax.scatter([x(w) for w in bad], [w["privacy"]["identified"] for w in bad], s=160, facecolors="none",
                       edgecolors="red", linewidths=2, zorder=4, label="beyond the bound")
    chance = points[0]["privacy"]["chance"]
    ax.axhline(chance, color="grey", linestyle=":", linewidth=1, label=f"a guess ({chance:.0%})")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("identification against the bound the guarantee sets", fontsize=11)
    delta = next(iter(summary["utility"].values()), {}).get("delta")
    _style(ax, (f"epsilon at delta {delta:g} (log scale)" if delta else "epsilon (log scale)") if by_epsilon
           else "mu of one update (log scale)", "share of targets identified")
    _save(fig, path)
    return True


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


def plot_reconstructions(folder: RunFolder, rows: dict[tuple, dict], metric: str, checkpoint: int,
                         path: Path) -> bool:
    """Originals on top, then one row per (setting, attack) at ``checkpoint``, each image titled with its score."""
    audit = folder.audit
    lines: list[tuple[str, torch.Tensor, list[float | None]]] = []
    originals = None
    for s in audit.settings:
        for a in audit.attacks:
            recs, origs, scores = [], [], []
            for t in range(audit.num_batches):
                job = AttackJob(s, a, checkpoint, t)
                saved = folder.load_reconstruction(job)
                if saved is not None:
                    recs.append(saved["reconstruction"])
                    origs.append(saved["original"])
                    each = _per_image(rows[job.key], metric) if job.key in rows else []
                    scores.extend(each if len(each) == len(saved["original"]) else [None] * len(saved["original"]))
            if recs:
                lines.append((f"{s.key} · {a.key}", torch.cat(recs)[:MAX_GRID_IMAGES], scores[:MAX_GRID_IMAGES]))
                originals = torch.cat(origs)[:MAX_GRID_IMAGES] if originals is None else originals
    if originals is None:
        return False
    n = len(originals)
    fig, axes = plt.subplots(len(lines) + 1, n, figsize=(1.25 * n + 2.4, 1.45 * (len(lines) + 1)), squeeze=False)
    for j in range(n):
        _show(axes[0][j], originals[j])
    axes[0][0].set_ylabel("original", rotation=0, ha="right", va="center", fontsize=9)
    for i, (label, imgs, scores) in enumerate(lines, start=1):
        for j in range(n):
            ax = axes[i][j]
            if j < len(imgs):
                _show(ax, imgs[j])
                if scores[j] is not None:
                    ax.set_title(f"{scores[j]:.3g}", fontsize=8, pad=2)
            else:
                ax.axis("off")
        axes[i][0].set_ylabel(_label(label), rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle(f"step {checkpoint}: reconstructions, each titled with its {metric}", fontsize=10)
    _save(fig, path)
    return True


def plot_worst_images(folder: RunFolder, summary: dict, path: Path) -> bool:
    """Per setting, the single most leaking reconstruction beside its original."""
    audit = folder.audit
    shown = []
    for w in summary["worst_case"]:
        at = w["worst_image"]
        if "target" not in at:
            continue
        saved = folder.load_reconstruction(_job(audit, w["setting"], at["attack"], at["checkpoint"], at["target"]))
        if saved is not None:
            shown.append((w, saved["original"][at["index"]], saved["reconstruction"][at["index"]]))
    if not shown:
        return False
    fig, axes = plt.subplots(2, len(shown), figsize=(2.3 * len(shown) + 1.2, 4.6), squeeze=False)
    for j, (w, orig, rec) in enumerate(shown):
        _show(axes[0][j], orig)
        _show(axes[1][j], rec)
        axes[0][j].set_title(_label(w["setting"], 22), fontsize=8)
        at = w["worst_image"]
        axes[1][j].set_xlabel(_label(f"{summary['leakage_metric']} {at['score']:.3g}, {at['attack']}, "
                                     f"step {at['checkpoint']}", 22), fontsize=8)
    axes[0][0].set_ylabel("original", fontsize=9)
    axes[1][0].set_ylabel("most leaking\nreconstruction", fontsize=9)
    _save(fig, path)
    return True


# --- the page ------------------------------------------------------------------------------------

def params_text(params: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _num(v: Any, digits: int = 4) -> str:
    """A table cell: floats to ``digits`` significant figures, mappings as parameters, None blank."""
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{digits}g}"
    if isinstance(v, dict):
        return params_text(v)
    return str(v)


def _interval(ci: list[float] | None) -> str:
    return "" if not ci else f"[{_num(ci[0], 3)}, {_num(ci[1], 3)}]"


def _epsilon(value: float | None, trained: bool = True) -> str:
    """Epsilon as a reader needs it: a number, or why there is none."""
    if not trained:
        return "not trained"
    if value is None:
        return "no guarantee"
    return "∞ (no noise)" if math.isinf(value) else f"{value:.3g}"


def _percent(v: float | None) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.0%}"


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def threat_model(audit: Audit) -> list[tuple[str, str]]:
    """What the attacker is given, line by line, for the report's threat box."""
    protocol = audit.protocol
    fields = {f.name: getattr(protocol, f.name) for f in dataclasses.fields(protocol)} if dataclasses.is_dataclass(
        protocol) else {}  # its settings, not its ClassVars
    adaptive = [a.key for a in audit.attacks if a.role == "adaptive"]
    naive = [a.key for a in audit.attacks if a.role != "adaptive"]
    return [
        ("Model weights", "the attacked checkpoint's weights and architecture (white box, as the server holds them)"),
        ("Model mode", "train: BatchNorm uses each update's batch statistics (model.mode)" if audit.model["mode"] ==
         "train" else "eval: BatchNorm uses the running statistics, as Geiping et al.'s code attacks (model.mode)"),
        ("Labels", "given to the attacker (threat.known_labels)" if audit.threat.get("known_labels")
         else "not given: each attack recovers them from the update"),
        ("Protocol", protocol.name + (f" ({params_text(fields)})" if fields else "")
         + f"; one update of {audit.data['batch_size']} private image(s)"),
        ("Defense", (f"known to {', '.join(adaptive)} (its likelihood, masks or noise draws)" if adaptive else
                     "no attack uses it") + (f"; ignored by {', '.join(naive)}" if naive else "")),
        _targets(audit),
        *([] if audit.live is None else [("Server's memory", audit.live.get("undone") or
                                          "none: each update is attacked alone (attacker: {memory: false})")]),
    ]


def _targets(audit: Audit) -> tuple[str, str]:
    """The threat box's line on the attacked images."""
    if audit.live is not None:
        return "Targets", "each audited step's batch, as the training loop drew it"
    return "Targets", (f"{audit.data['targets']} images of the {audit.data['target_split']} split"
                       + (" (its first ones)" if audit.data["target_order"] == "first" else "")
                       + (", never seen in training or tuning" if audit.data["target_split"] == "test"
                          else ", trained on but never tuned on"))


def provenance(audit: Audit, run_info: dict[str, Any]) -> list[tuple[str, str]]:
    """Versions, device, seed, date and run time, for the report's provenance box."""
    sessions = run_info.get("sessions", [])
    seconds = sum(s.get("seconds") or 0 for s in sessions)
    versions = run_info.get("versions", {})
    return [
        ("Versions", ", ".join(f"{k} {v}" for k, v in versions.items()) or "not recorded"),
        ("Device", run_info.get("device", audit.device)),
        ("Seed", str(audit.seed)),
        ("Started", sessions[0]["started"] if sessions else "not recorded"),
        ("Run time", f"{seconds / 60:.1f} min over {len(sessions)} session(s)" if sessions else "not recorded"),
        ("Audit file", run_info.get("audit_file", str(audit.path))),
    ]


def page_template(template: Path | None = None) -> jinja2.Template:
    """The page's template: the built-in one, or the user's, which may ``{% extends "report.html.j2" %}`` (the
    built-in one is found first, so a user's file of that name does not extend itself) and include files
    beside it. Raises ``jinja2.TemplateError`` for a template that does not compile."""
    folders = [str(TEMPLATES)] + ([] if template is None else [str(template.parent)])
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(folders), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=_num, interval=_interval, epsilon=_epsilon, percent=_percent, params=params_text)
    return env.get_template(TEMPLATE) if template is None else env.from_string(template.read_text())


def write_report(folder: RunFolder, rows: list[dict], utility: list[dict],
                 baselines: dict[str, dict[str, float | None]], tuning: list[dict],
                 architecture: list[dict[str, Any]], run_info: dict[str, Any] | None = None,
                 template: Path | None = None) -> dict:
    """Write summary.json, the figures and a self-contained report.html; return the summary.

    Nothing here attacks or trains: it reads what the run wrote, so it can be rebuilt from the folder.
    """
    audit, out_dir = folder.audit, folder.path
    run_info = run_info or {}
    notes = sorted({n for r in rows for n in r.get("notes", [])})  # what a metric could not compute, per row
    summary = summarise(audit, rows, utility, notes, baselines, run_info, identifiability(folder, rows))
    summary.update(baselines=baselines, tuning=summarise_tuning(audit, tuning, summary["warnings"]),
                   architecture=architecture, run=run_info)
    by_key = {row_key(r): r for r in rows}
    figures: dict[str, str | None] = {}
    for name, draw in (("privacy_utility", lambda p: plot_privacy_utility(summary, p)),
                       ("leakage_by_epsilon", lambda p: plot_leakage_by_epsilon(summary, p)),
                       ("identification_bound", lambda p: plot_identification_bound(summary, p)),
                       ("leakage_by_step", lambda p: plot_leakage_by_step(summary, p)),
                       ("worst_images", lambda p: plot_worst_images(folder, summary, p))):
        path = out_dir / f"{name}.png"
        figures[name] = _data_uri(path) if draw(path) else None
    grids = []
    for ckpt in audit.checkpoints:
        path = out_dir / f"reconstructions_step{ckpt}.png"
        if plot_reconstructions(folder, by_key, summary["leakage_metric"], ckpt, path):
            grids.append((ckpt, _data_uri(path)))
    summary["figures"] = [f"{name}.png" for name, uri in figures.items() if uri] + [
        f"reconstructions_step{ckpt}.png" for ckpt, _ in grids]
    folder.write_json(SUMMARY, summary)  # after the figures, so that it names them
    extras = []
    if audit.registry.pm is not None:
        for extra in audit.registry.pm.hook.report_extras(summary=summary, audit=audit, out_dir=out_dir):
            extras.extend((title, jinja2.utils.markupsafe.Markup(content)) for title, content in extra or [])
    page = page_template(template).render(
        summary=summary, audit=audit, figures=figures, grids=grids, extras=extras,
        threat=threat_model(audit), provenance=provenance(audit, run_info),
        metrics=audit.metrics, leak=summary["leakage_metric"],
        second=[m for m in SECOND_METRICS if m in audit.metrics and m != summary["leakage_metric"]],
        trained=audit.utility["train_steps"] > 0, max_images=MAX_GRID_IMAGES, live=audit.live is not None)
    folder.write_text(REPORT, page)
    return summary
