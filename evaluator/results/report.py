"""Reports: summary.json with verdicts and intervals, the figures, and report.html rendered from a template.

Everything shown was computed during the run (rows, utility, baselines, the architecture analysis,
the run's provenance), so ``leakaudit report DIR`` writes the same report again without an attack.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

import jinja2
from torch import Tensor

from leakaudit.evaluator.audit.budget import budget_lines, skipped_lines, skipped_of
from leakaudit.evaluator.audit.checks import example_unit
from leakaudit.evaluator.audit.materials import load_data
from leakaudit.evaluator.audit.types import Audit, params_text
from leakaudit.evaluator.results.figures import (
    MAX_GRID_IMAGES,
    plot_identification_bound,
    plot_leakage_by_epsilon,
    plot_leakage_by_step,
    plot_privacy_utility,
    plot_reconstructions,
    plot_worst_images,
    worst_batches,
)
from leakaudit.evaluator.results.identify import identifiability
from leakaudit.evaluator.results.provenance import public_run
from leakaudit.evaluator.results.rows import Row
from leakaudit.evaluator.results.rundir import CONFIRMED, REPORT, SUMMARY, VOCABULARY, RunFolder
from leakaudit.evaluator.results.summary import second_views, summarise, summarise_tuning
from leakaudit.evaluator.results.types import Summary, WorstCase
from leakaudit.evaluator.results.verdict import open_questions, rule_text, threat_text
from leakaudit.plugins.text import TokenData, decode_tokens


TEMPLATES = Path(__file__).parent / "templates"
TEMPLATE = "report.html.j2"


def _accuracy(v: float | None) -> str:
    """An accuracy in a column of accuracies: three decimals always (0.100 beside 0.903, not 0.1)."""
    return "" if v is None else f"{v:.3f}"


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
    fields: dict[str, Any] = {f.name: getattr(protocol, f.name) for f in dataclasses.fields(protocol)} \
        if dataclasses.is_dataclass(protocol) else {}  # its settings, not its ClassVars
    clients = fields.pop("clients", 1)
    shuffled = fields.pop("shuffle", False)
    per_element = fields.pop("secure_aggregation", "sum") == "per_element"
    own = sorted({s.clients for s in audit.settings if s.clients is not None})
    unit = example_unit(audit)
    seen = (f"; one update of {audit.data.batch_size} private {unit}(s)" if clients == 1 and not own else
            f"; under secure aggregation the server sees only the mean of {clients} clients' updates, "
            f"each of {audit.data.batch_size // clients} private {unit}(s)")
    if shuffled:
        seen += "; each local epoch in an order the client draws and the server does not know"
    if per_element and clients > 1:
        seen += ("; sparse updates aggregated per coordinate: the server learns how many clients sent each one, and "
                 "reads a coordinate one client alone sent as that client's (Suimon et al. 2025)")
    if own:
        seen += f" (settings that name their clients: the mean of {', '.join(map(str, own))} clients' updates)"
    adaptive = [a.key for a in audit.attacks if a.role == "adaptive"]
    naive = [a.key for a in audit.attacks if a.role != "adaptive"]
    spec = audit.registry.get("model", audit.model.name) if audit.model.name in audit.registry.names("model") \
        else None
    return [
        ("Server", f"malicious: {spec.malicious}" if spec is not None and spec.malicious else
         "honest but curious: it sends the model as trained and attacks what comes back"),
        ("Model weights", "the attacked checkpoint's weights and architecture (white box, as the server holds them)"),
        ("Model mode", f"{audit.model.mode} (model.mode): dropout {'on' if audit.model.mode == 'train' else 'off'}; a "
         "transformer's LayerNorm keeps no batch statistics" if unit == "sentence" else
         "train: BatchNorm uses each update's batch statistics (model.mode)" if audit.model.mode == "train" else
         "eval: BatchNorm uses the running statistics, as Geiping et al.'s code attacks (model.mode)"),
        ("Labels", "each sentence's own next words: each attack reads them off the sentence it rebuilds (the last "
         "word from the output layer's gradient)" if learns_next_token(audit) else
         "given to the attacker (threat.known_labels)" if audit.threat.known_labels
         else "not given: each attack recovers them from the update"),
        ("Protocol", protocol.name + (f" ({params_text(fields)})" if fields else "") + seen),
        ("Defense", (f"known to {', '.join(adaptive)} (its likelihood, masks or noise draws)" if adaptive else
                     "no attack uses it") + (f"; ignored by {', '.join(naive)}" if naive else "")),
        _targets(audit),
        *([("Secure aggregation", audit.live["secure_aggregation"])]
          if audit.live and audit.live.get("secure_aggregation") else []),
        *([] if audit.live is None else [("Server's memory", audit.live.get("undone") or
                                          "none: each update is attacked alone (attacker: {memory: false})")]),
        *([("Dropout", f"the client's masks (p = {', '.join(map(str, audit.live['dropout']))}) are not known to the "
                       "attacker: each attack draws masks of its own, as the model runs in train mode")]
          if audit.live and audit.live.get("dropout") and audit.live.get("mode") == "train" else []),
    ]


def _targets(audit: Audit) -> tuple[str, str]:
    """The threat box's line on the attacked images."""
    if audit.live is not None:
        return "Targets", "each audited step's batch, as the training loop drew it"
    return "Targets", (f"{audit.data.targets} {example_unit(audit)}s of the {audit.data.target_split} split"
                       + (" (its first ones)" if audit.data.target_order == "first" else "")
                       + (", never seen in training or tuning" if audit.data.target_split == "test"
                          else ", trained on but never tuned on"))


def leakage_by_clients(audit: Audit, summary: Summary) -> tuple[list[int], list[tuple[str, dict[int, WorstCase]]]]:
    """The settings that name their number of clients, as a table: each defense (its setting without the clients)
    against every number of clients, each cell that setting's worst case. Empty where no setting names any."""
    cases = {w.setting: w for w in summary.worst_case}
    table: dict[str, dict[int, WorstCase]] = {}
    for s in audit.settings:
        if s.clients is not None and s.key in cases:
            table.setdefault(dataclasses.replace(s, clients=None).identity, {})[s.clients] = cases[s.key]
    counts = sorted({n for row in table.values() for n in row})
    return counts, list(table.items())


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
        ("Audit file", Path(run_info.get("audit_file", audit.path)).name),
    ] + digest_rows(run_info.get("provenance") or {}) + _auto_row(run_info.get("attack_choice") or []) + (
        [("Budget", "; ".join(budget_lines(run_info["budget"])))] if run_info.get("budget") else
        [("Settled", line.strip()) for line in skipped_lines(skipped_of(run_info))])


def digest_rows(record: dict[str, Any]) -> list[tuple[str, str]]:
    """The provenance box's digests (``results.provenance``): each file by its name beside the audit file, the
    model's initial state, and the command that recomputes them."""
    if not record:
        return []
    return [(f"SHA-256 of {name}", digest) for name, digest in record["sha256"].items()] + [
        ("Check", f"leakaudit {record['leakaudit']}: leakaudit report RUN_FOLDER --check recomputes these digests")]


def _auto_row(choice: list[str]) -> list[tuple[str, str]]:
    """The provenance row of ``attacks: auto``: what it chose when the run started (none: the file listed them)."""
    if not choice:
        return []
    chosen = [line.split(": ", 1)[0] for line in choice if line.split(": ", 1)[1].startswith("chosen")]
    return [("Attacks", f"attacks: auto chose {', '.join(chosen)}; the other {len(choice) - len(chosen)} registered "
                        "attacks do not apply here or another does their work (leakaudit validate says why)")]


def page_template(template: Path | None = None) -> jinja2.Template:
    """The page's template: the built-in one, or the user's, which may ``{% extends "report.html.j2" %}`` (the
    built-in one is found first, so a user's file of that name does not extend itself) and include files
    beside it. Raises ``jinja2.TemplateError`` for a template that does not compile."""
    folders = [str(TEMPLATES)] + ([] if template is None else [str(template.parent)])
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(folders), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=_num, interval=_interval, epsilon=_epsilon, percent=_percent, params=params_text,
                       accuracy=_accuracy, open_questions=open_questions, threat_text=threat_text)
    return env.get_template(TEMPLATE) if template is None else env.from_string(template.read_text())


def judged(folder: RunFolder, rows: list[Row], utility: list[dict], baselines: dict[str, dict[str, float | None]],
           run_info: dict[str, Any] | None) -> Summary:
    """The summary of a folder's rows, every verdict judged, with nothing written (a monitor's step verdict)."""
    notes = sorted({n for r in rows for n in r.notes})  # what a metric could not compute, per row
    return summarise(folder.audit, rows, utility, notes, baselines, run_info, identifiability(folder, rows),
                     folder.read_json(CONFIRMED))


def write_report(folder: RunFolder, rows: list[Row], utility: list[dict],
                 baselines: dict[str, dict[str, float | None]], tuning: list[dict],
                 architecture: list[dict[str, Any]], run_info: dict[str, Any] | None = None,
                 template: Path | None = None) -> Summary:
    """Write summary.json, the figures and a self-contained report.html; return the summary.

    Nothing here attacks or trains: it reads what the run wrote, so it can be rebuilt from the folder.
    """
    audit, out_dir = folder.audit, folder.path
    run_info = run_info or {}
    summary = judged(folder, rows, utility, baselines, run_info)
    summary.baselines, summary.architecture, summary.run = baselines, architecture, public_run(run_info)
    summary.tuning = summarise_tuning(audit, tuning, summary.warnings)
    by_key = {r.key: r for r in rows}
    unit = example_unit(audit)
    text = unit == "sentence"
    figures: dict[str, str | None] = {}
    for name, draw in (("privacy_utility", lambda p: plot_privacy_utility(summary, p, audit.registry)),
                       ("leakage_by_epsilon", lambda p: plot_leakage_by_epsilon(summary, p)),
                       ("identification_bound", lambda p: plot_identification_bound(summary, p)),
                       ("leakage_by_step", lambda p: plot_leakage_by_step(summary, p, step_unit(audit))),
                       ("worst_images", lambda p: not text and plot_worst_images(folder, summary, p))):
        path = out_dir / f"{name}.png"
        figures[name] = _data_uri(path) if draw(path) else None
    grids = []
    for ckpt in [] if text else audit.checkpoints:
        path = out_dir / f"reconstructions_step{ckpt}.png"
        if plot_reconstructions(folder, by_key, summary.leakage_metric, ckpt, path):
            grids.append((ckpt, _data_uri(path)))
    sentences = recovered_sentences(folder, summary, rows) if text else []
    summary.figures = [f"{name}.png" for name, uri in figures.items() if uri] + [
        f"reconstructions_step{ckpt}.png" for ckpt, _ in grids]
    folder.write_json(SUMMARY, summary.to_json())  # after the figures, so that it names them
    extras: list[tuple[str, jinja2.utils.markupsafe.Markup]] = []
    if audit.registry.pm is not None:
        for extra in audit.registry.pm.hook.report_extras(summary=summary, audit=audit, out_dir=out_dir):
            extras.extend((title, jinja2.utils.markupsafe.Markup(content)) for title, content in extra or [])
    page = page_template(template).render(
        summary=summary, audit=audit, figures=figures, grids=grids, extras=extras,
        threat=threat_model(audit), provenance=provenance(audit, run_info), clients=leakage_by_clients(audit, summary),
        metrics=audit.metrics, leak=summary.leakage_metric,
        second=[m for m in second_views(audit.registry) if m in audit.metrics and m != summary.leakage_metric],
        trained=audit.utility.train_steps > 0 or audit.live is not None, train_steps=trained_steps(audit, utility),
        update_sizes=update_sizes(audit, rows), max_images=MAX_GRID_IMAGES, live=audit.live is not None,
        sentences=sentences, unit=unit, rule=rule_text(summary, audit.data.targets, unit, *(
            ["the most frequent next word's share"] if learns_next_token(audit) else [])))
    folder.write_text(REPORT, page)
    return summary


def step_unit(audit: Audit) -> str:
    """What a checkpoint counts: a federated client's rounds (a monitor bound to rounds), else training steps."""
    return "round" if audit.live is not None and "fits" in audit.live else "training step"


def trained_steps(audit: Audit, utility: list[dict]) -> int:
    """The training steps the accuracy was measured after: the audit's utility training, or the steps a monitor
    watched (its last measure's)."""
    if audit.live is None:
        return audit.utility.train_steps
    return max((int(u.get("train_steps") or 0) for u in utility), default=0)


def update_sizes(audit: Audit, rows: list[Row]) -> str:
    """The sizes of the attacked updates: the audit's batch size, or what a monitor really attacked (Poisson
    batches under Opacus, a round's images), a range where they vary."""
    sizes = sorted({len(r.images) for r in rows if r.images}) if audit.live is not None else []
    if not sizes:
        return str(audit.data.batch_size)
    return str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}"


def learns_next_token(audit: Audit) -> bool:
    """Whether the audit's model is a registered language model trained on the next token (a keyboard's)."""
    name = audit.model.name
    return name in audit.registry.names("model") and audit.registry.get("model", name).task == "next_token"


def sentence_decoder(audit: Audit) -> Callable[[Tensor], str]:
    """Token ids to words: the dataset's vocabulary, a monitored loop's ``vocabulary``, else the ids themselves."""
    if audit.live is None:
        data = load_data(audit)
        assert isinstance(data, TokenData), "only a text audit's sentences are decoded"
        return data.decode
    saved = audit.path.parent / VOCABULARY
    words, pad = json.loads(saved.read_text()) if saved.is_file() else None, audit.live.get("pad_id", 0)
    return lambda ids: decode_tokens(ids, words, pad)


def recovered_sentences(folder: RunFolder, summary: Summary, rows: list[Row]) -> list[dict[str, Any]]:
    """For each setting of a text audit, its strongest attack's most leaking target batch: each original sentence
    beside the recovered one, which of the original's words came back, and the setting's PII recall (the mean over
    that attack's rows at that step)."""
    decode = sentence_decoder(folder.audit)
    out = []
    for w, at, saved in worst_batches(folder, summary):
        recalls = [r.pii_recall for r in rows
                   if r.cell == (w.setting, at.attack, at.checkpoint) and r.pii_recall is not None]
        pairs = []
        for orig, rec in zip(saved["original"], saved["reconstruction"]):
            original, recovered = decode(orig), decode(rec)
            words = set(recovered.split())
            pairs.append({"original": original, "recovered": recovered,
                          "same": [word in words for word in original.split()]})
        out.append({"setting": w.setting, "attack": at.attack, "checkpoint": at.checkpoint, "score": at.score,
                    "pii_recall": sum(recalls) / len(recalls) if recalls else None, "pairs": pairs})
    return out
