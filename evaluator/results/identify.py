"""Identifiability: whether each reconstruction is nearest its own original among all the audit's targets
(one image per update, beyond what the classes explain: ``verdict.class_aware_test``), and for batches whether the reconstructions name their own update's originals among
decoys of the same classes (``verdict.decoy_test``), cached in the run folder."""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import torch

from leakaudit.evaluator.audit.jobs import job_at
from leakaudit.evaluator.audit.types import Audit
from leakaudit.evaluator.results.rows import Row
from leakaudit.evaluator.results.rundir import IDENTIFIABLE, RunFolder
from leakaudit.evaluator.results.summary import ranked_metrics
from leakaudit.evaluator.results.verdict import (class_aware_test, decoy_groups, decoy_test, identifiable_share,
                                                 named_share)
from leakaudit.plugins.components import Metric


def _cell_batches(folder: RunFolder, key: tuple[str, str, int]) -> list[dict] | None:
    """A cell's saved target batches, each with its reconstructions, originals and labels (None when one is
    missing)."""
    setting = job_at(folder.audit, *key, 0).setting
    batches = [folder.load_reconstruction(job_at(folder.audit, *key, t))
               for t in range(folder.audit.num_batches_of(setting))]
    kept = [b for b in batches if b is not None]
    return None if len(kept) < len(batches) else kept


def _distances(metric, recs: torch.Tensor, others: torch.Tensor, chunk: int = 512) -> np.ndarray:
    """Distance of every reconstruction (rows) to every other image (columns), lower meaning closer."""
    n, m = len(recs), len(others)
    pairs = torch.arange(n * m)
    values = torch.cat([metric.fn(recs[idx // m], others[idx % m]).detach().cpu()
                        for idx in pairs.split(chunk)])  # n x m pairs, built a chunk at a time
    d = values.view(n, m).double().numpy()
    return -d if metric.higher_is_better else d


def _decoy_result(metric, batches: list[dict], distances: np.ndarray, decoys: dict) -> list:
    """``decoy_test`` over a cell's updates: [hits, originals, p-value]. ``distances``: the cell's reconstructions
    to its originals, whose blocks on the diagonal are each update's own."""
    own, near, groups, start = [], [], [], 0
    for saved in batches:
        mine = decoy_groups(saved["labels"].numpy(), decoys["labels"].numpy())
        used = sorted({d for g in mine for d in g})
        where = {d: i for i, d in enumerate(used)}
        recs = saved["reconstruction"].float()
        own.append(distances[start:start + len(recs), start:start + len(recs)])
        near.append(_distances(metric, recs, decoys["images"][used].float()) if used else np.empty((len(recs), 0)))
        groups.append([[where[d] for d in g] for g in mine])
        start += len(recs)
    return list(decoy_test(own, near, groups))


def _class_aware_result(batches: list[dict], distances: np.ndarray) -> list | None:
    """``class_aware_test`` over a cell of one example per update: [hits, targets, p-value]; None where an example
    has more than one label (a language model's tokens), which no class template stands for."""
    labels = torch.cat([b["labels"].reshape(len(b["labels"]), -1) for b in batches])
    return list(class_aware_test(distances, labels[:, 0].numpy())) if labels.shape[1] == 1 else None


def identifying_metric(audit: Audit, rows: list[Row]) -> Metric:
    """The distance that names a reconstruction's nearest original (``Metric.distance_rank``): the measured one
    of lowest rank (LPIPS among the built-ins), else the registered one of highest rank (MSE, which needs nothing)."""
    kinds = {audit.registry.get("metric", m).modality for m in audit.metrics} - {"any"}
    modality = kinds.pop() if len(kinds) == 1 else "image"  # validation keeps an audit's metrics to its data's kind
    ranked = [m for m in ranked_metrics(audit.registry, "distance_rank") if m.modality == modality]
    measured = [m for m in ranked if m.name in audit.metrics and any(r.metrics.get(m.name) is not None for r in rows)]
    return (measured or ranked[::-1])[0]


def identifiability(folder: RunFolder, rows: list[Row]) -> tuple[str, dict[tuple, list | None]]:
    """Per cell, the share of reconstructions whose nearest original among the audit's targets is their own
    (after matching each to an original of its update), the share of targets named from the reconstructions
    alone (``named_share``), and the test against a guess that knows the classes ([hits, originals, p-value] or
    None: ``class_aware_test`` for one image per update, the decoy test for batches), by the metric
    ``identifying_metric`` picks; cached in the run folder."""
    audit = folder.audit
    metric = identifying_metric(audit, rows)
    by = metric.name
    cache = folder.read_json(IDENTIFIABLE) or {}
    counts: dict[tuple[str, str, int], int] = defaultdict(int)
    for r in rows:
        counts[r.cell] += 1
    out, changed, decoys = {}, False, None
    for key, n in counts.items():
        name = json.dumps([*key, n, by, "named", "decoys", "classes"])
        if name not in cache:
            batches = _cell_batches(folder, key)
            # the first client's images alone where its coordinates were read (per-element secure aggregation)
            sizes = {len(b["original"]) for b in batches or []}
            batch = sizes.pop() if len(sizes) == 1 else audit.batch_size_of(job_at(audit, *key, 0).setting)
            # updates read in two ways: no one test fits; one original in all: nothing to be nearest among
            if batches is None or audit.data.targets < 2 or sizes or sum(len(b["original"]) for b in batches) < 2:
                cache[name] = None
            else:
                recs = torch.cat([b["reconstruction"].float() for b in batches])
                distances = _distances(metric, recs, torch.cat([b["original"].float() for b in batches]))
                if batch > 1 and decoys is None:
                    decoys = folder.load_decoys()  # once for all cells
                tested = (_class_aware_result(batches, distances) if batch == 1 else
                          None if decoys is None else _decoy_result(metric, batches, distances, decoys))
                cache[name] = [identifiable_share(distances), named_share(distances, batch), tested]
            changed = True
        out[key] = cache[name]
    if changed:
        folder.write_json(IDENTIFIABLE, cache)
    return by, out
