"""Identifiability: whether each reconstruction is nearest its own original among all the audit's targets
(one image per update), cached in the run folder."""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import torch

from leakaudit.evaluator.audit.jobs import job_at
from leakaudit.evaluator.audit.types import Audit
from leakaudit.evaluator.results.rundir import IDENTIFIABLE, RunFolder
from leakaudit.evaluator.results.summary import ranked_metrics
from leakaudit.evaluator.results.verdict import identifiable_share, named_share
from leakaudit.plugins.components import Metric


def _cell_images(folder: RunFolder, key: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cell's reconstructions and originals over all its target batches (None when one is missing)."""
    recs, origs = [], []
    setting = job_at(folder.audit, *key, 0).setting
    for t in range(folder.audit.num_batches_of(setting)):
        saved = folder.load_reconstruction(job_at(folder.audit, *key, t))
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


def identifying_metric(audit: Audit, rows: list[dict]) -> Metric:
    """The distance that names a reconstruction's nearest original (``Metric.distance_rank``): the measured one
    of lowest rank (LPIPS among the built-ins), else the registered one of highest rank (MSE, which needs nothing)."""
    ranked = ranked_metrics(audit.registry, "distance_rank")
    measured = [m for m in ranked if m.name in audit.metrics and any(r.get(m.name) is not None for r in rows)]
    return (measured or ranked[::-1])[0]


def identifiability(folder: RunFolder, rows: list[dict]) -> tuple[str, dict[tuple, list | None]]:
    """Per cell, the share of reconstructions whose nearest original among the audit's targets is their own
    (after matching each to an original of its update), and the share of targets named from the reconstructions
    alone (``named_share``), by the metric ``identifying_metric`` picks; cached in the run folder."""
    audit = folder.audit
    metric = identifying_metric(audit, rows)
    by = metric.name
    cache = folder.read_json(IDENTIFIABLE) or {}
    counts: dict[tuple, int] = defaultdict(int)
    for r in rows:
        counts[(r["setting"], r["attack"], r["checkpoint"])] += 1
    out, changed = {}, False
    for key, n in counts.items():
        name = json.dumps([*key, n, by, "named"])
        if name not in cache:
            images = _cell_images(folder, key)
            distances = None if images is None or audit.data.targets < 2 else _distances(metric, *images)
            batch = audit.batch_size_of(job_at(audit, *key, 0).setting)
            cache[name] = None if distances is None else [identifiable_share(distances), named_share(distances, batch)]
            changed = True
        out[key] = cache[name]
    if changed:
        folder.write_json(IDENTIFIABLE, cache)
    return by, out
