"""Identifiability: whether each reconstruction is nearest its own original among all the audit's targets
(one image per update), and for batches whether the reconstructions name their own update's originals among
decoys of the same classes (``verdict.decoy_test``), cached in the run folder."""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import torch

from leakaudit.evaluator.audit.jobs import job_at
from leakaudit.evaluator.audit.types import Audit
from leakaudit.evaluator.results.rundir import IDENTIFIABLE, RunFolder
from leakaudit.evaluator.results.summary import ranked_metrics
from leakaudit.evaluator.results.verdict import decoy_groups, decoy_test, identifiable_share, named_share
from leakaudit.plugins.components import Metric


def _cell_batches(folder: RunFolder, key: tuple) -> list[dict] | None:
    """A cell's saved target batches, each with its reconstructions, originals and labels (None when one is
    missing)."""
    setting = job_at(folder.audit, *key, 0).setting
    batches = [folder.load_reconstruction(job_at(folder.audit, *key, t))
               for t in range(folder.audit.num_batches_of(setting))]
    return None if any(b is None for b in batches) else batches


def _distances(metric, recs: torch.Tensor, others: torch.Tensor, chunk: int = 512) -> np.ndarray:
    """Distance of every reconstruction (rows) to every other image (columns), lower meaning closer."""
    n, m = len(recs), len(others)
    pairs = torch.arange(n * m)
    values = torch.cat([metric.fn(recs[idx // m], others[idx % m]).detach().cpu()
                        for idx in pairs.split(chunk)])  # n x m pairs, built a chunk at a time
    d = values.view(n, m).double().numpy()
    return -d if metric.higher_is_better else d


def _decoy_result(metric, batches: list[dict], decoys: dict | None) -> list | None:
    """``decoy_test`` over a cell's updates: [hits, originals, p-value]; None without decoys."""
    if decoys is None:
        return None
    own, near, groups = [], [], []
    for saved in batches:
        mine = decoy_groups(saved["labels"].numpy(), decoys["labels"].numpy(), set())
        used = sorted({d for g in mine for d in g})
        where = {d: i for i, d in enumerate(used)}
        recs = saved["reconstruction"].float()
        own.append(_distances(metric, recs, saved["original"].float()))
        near.append(_distances(metric, recs, decoys["images"][used].float()) if used else np.empty((len(recs), 0)))
        groups.append([[where[d] for d in g] for g in mine])
    return list(decoy_test(own, near, groups))


def identifying_metric(audit: Audit, rows: list[dict]) -> Metric:
    """The distance that names a reconstruction's nearest original (``Metric.distance_rank``): the measured one
    of lowest rank (LPIPS among the built-ins), else the registered one of highest rank (MSE, which needs nothing)."""
    ranked = ranked_metrics(audit.registry, "distance_rank")
    measured = [m for m in ranked if m.name in audit.metrics and any(r.get(m.name) is not None for r in rows)]
    return (measured or ranked[::-1])[0]


def identifiability(folder: RunFolder, rows: list[dict]) -> tuple[str, dict[tuple, list | None]]:
    """Per cell, the share of reconstructions whose nearest original among the audit's targets is their own
    (after matching each to an original of its update), the share of targets named from the reconstructions
    alone (``named_share``), and for batches the decoy test ([hits, originals, p-value] or None), by the metric
    ``identifying_metric`` picks; cached in the run folder."""
    audit = folder.audit
    metric = identifying_metric(audit, rows)
    by = metric.name
    cache = folder.read_json(IDENTIFIABLE) or {}
    counts: dict[tuple, int] = defaultdict(int)
    for r in rows:
        counts[(r["setting"], r["attack"], r["checkpoint"])] += 1
    out, changed = {}, False
    for key, n in counts.items():
        name = json.dumps([*key, n, by, "named", "decoys"])
        if name not in cache:
            batches = _cell_batches(folder, key)
            batch = audit.batch_size_of(job_at(audit, *key, 0).setting)
            if batches is None or audit.data.targets < 2:
                cache[name] = None
            else:
                recs = torch.cat([b["reconstruction"].float() for b in batches])
                distances = _distances(metric, recs, torch.cat([b["original"].float() for b in batches]))
                decoys = _decoy_result(metric, batches, folder.load_decoys()) if batch > 1 else None
                cache[name] = [identifiable_share(distances), named_share(distances, batch), decoys]
            changed = True
        out[key] = cache[name]
    if changed:
        folder.write_json(IDENTIFIABLE, cache)
    return by, out
