"""Architecture analysis before any attack: Chen & Campbell's (2022) rank deficiencies and security metric.

The systems are built for the audit's model at training step 0 on its first target image
(their ranks are generic: Chen & Campbell 2022 found the same values untrained and trained, and for
different images).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from leakaudit.attacks.linear_system import conv_systems, security_metric
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.audit.types import DefenseSetting
from leakaudit.evaluator.run.scenario import Scenario, cache_root, write_cached, loss_fn
from leakaudit.plugins.components import ImageData

#: The largest dense system the rank computation builds (float64).
ANALYSIS_MAX_BYTES = 2 << 30


def analyse(scenario: Scenario, setting: DefenseSetting | None = None) -> dict[str, Any]:
    """Per convolutional layer: input shape, equations, unknowns, rank deficiency; and the metric.

    The audit's ``model:`` (undefended), or the model of ``setting`` when it has its own.
    Raises ValueError when the model is not a chain the linear systems cover.
    """
    section = scenario.model_section(setting)
    model = scenario.fresh_model(NoDefense(), setting).double()
    pixels, labels = scenario.target_batch(0)
    image = scenario.normalise(pixels[:1]).double()
    systems = conv_systems(model, loss_fn, image, labels[:1])
    for s in systems:
        need = 8 * s.rhs.numel() * s.unknowns
        if need > ANALYSIS_MAX_BYTES:
            raise ValueError(f"layer {s.name}'s system ({s.rhs.numel()} equations x {s.unknowns} unknowns) would take "
                             f"{need / 2 ** 30:.1f} GiB as a dense matrix, more than the analysis's "
                             f"{ANALYSIS_MAX_BYTES / 2 ** 30:.0f} GiB; analyse at a smaller image_size")
    layers: list[dict] = [{"layer": s.name, "input_shape": list(s.input_shape), "equations": s.matrix.shape[0],
                           "unknowns": s.unknowns, "rank_deficiency": s.rank_deficiency()} for s in systems]
    return {"model": section.name, "layers": layers,
            "metric": security_metric([layer["rank_deficiency"] for layer in layers])}


def cache_dir() -> Path:
    """Where analyses of zoo models are kept between runs."""
    return cache_root() / "analysis"


def _cache_file(scenario: Scenario, section: Any) -> Path | None:
    """The cache entry of a zoo model at this input shape and class count (ranks do not depend on the
    weights); None for a user's factory, whose code may change under the same name."""
    if ":" in section.name:
        return None
    data = scenario.data
    assert isinstance(data, ImageData), "the architecture analysis reads image models"
    key = repr((section.name, sorted(section.params.items()), data.channels, data.num_classes,
                scenario.audit.data.image_size, torch.__version__, ANALYSIS_VERSION))
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


ANALYSIS_VERSION = 1  # bump when analyse() changes what it computes


def cached_analysis(scenario: Scenario, setting: DefenseSetting | None = None) -> dict[str, Any]:
    """``analyse``, or why it does not apply, read from the cache when this zoo model at this input shape
    was analysed before (ranks do not depend on the weights), so only the first audit of a model pays
    for the rank computations."""
    section = scenario.model_section(setting)
    path = _cache_file(scenario, section)
    if path is not None and path.exists():
        return json.loads(path.read_text())
    try:
        result = analyse(scenario, setting)
    except ValueError as exc:
        result = {"model": section.name, "not_applicable": str(exc)}
    if path is not None:
        write_cached(path, result)
    return result


def analyse_all(scenario: Scenario) -> list[dict[str, Any]]:
    """``cached_analysis`` for the audit's model and for each entry's own model, each model once."""
    out, seen = [], set()
    for setting in [None, *scenario.audit.settings]:
        section = scenario.model_section(setting)
        key = repr((section.name, section.params))
        if key not in seen:
            seen.add(key)
            out.append(cached_analysis(scenario, setting))
    return out


def describe(result: dict[str, Any]) -> str:
    """The analysis as a small table and one line on the metric."""
    lines = [f"model {result['model']}: one linear system per convolutional layer (Chen & Campbell 2022, Sec. 3)",
             f"{'layer':<8}{'input':<14}{'equations':>10}{'unknowns':>10}{'rank deficiency':>17}"]
    for layer in result["layers"]:
        shape = "x".join(map(str, layer["input_shape"]))
        lines.append(f"{layer['layer']:<8}{shape:<14}{layer['equations']:>10}{layer['unknowns']:>10}"
                     f"{layer['rank_deficiency']:>17}")
    lines.append(f"security metric (Chen & Campbell 2022, Def. 3.3): {result['metric']:.1f}  (0: every convolutional "
                 "layer's input is determined by its gradients; more negative: less leakage to expect)")
    return "\n".join(lines)
