"""Architecture analysis before any attack: Chen & Campbell's (2022) rank deficiencies and security metric.

The systems are built for the audit's model at training step 0 on its first target image
(their ranks are generic: Chen & Campbell 2022 found the same values untrained and trained, and for
different images).
"""
from __future__ import annotations

from typing import Any

from leakaudit.attacks.linear_system import conv_systems, security_metric
from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.config import DefenseSetting
from leakaudit.evaluator.scenario import Scenario, loss_fn


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
    layers = [{"layer": s.name, "input_shape": list(s.input_shape), "equations": s.matrix.shape[0],
               "unknowns": s.unknowns, "rank_deficiency": s.rank_deficiency()} for s in systems]
    return {"model": section["name"], "layers": layers,
            "metric": security_metric([layer["rank_deficiency"] for layer in layers])}


def analyse_all(scenario: Scenario) -> list[dict[str, Any]]:
    """``analyse`` for the audit's model and each entry's own model, or why it does not apply."""
    out, seen = [], set()
    for setting in [None, *scenario.audit.settings]:
        section = scenario.model_section(setting)
        key = repr((section["name"], section["params"]))
        if key in seen:
            continue
        seen.add(key)
        try:
            out.append(analyse(scenario, setting))
        except ValueError as exc:
            out.append({"model": section["name"], "not_applicable": str(exc)})
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
