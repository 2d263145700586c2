"""``leakaudit init``: a commented starter audit for the defenses a user names, checked before it is written."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.specs import DATA, MODEL, TOP
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.plugins.manager import Registry
from leakaudit.plugins.protocol import FEDSGD
from leakaudit.plugins.spec import Param, did_you_mean


#: What a starter audit attacks when the user names no defense: the undefended reference and Gaussian noise.
DEFAULT_DEFENSES = ("gaussian",)
COMMENT_AT = 28  # column of the comments after short lines


@dataclass(frozen=True)
class Starter:
    """What a starter audit of one kind of example holds: its data, model, classic attack and metrics."""

    dataset: str
    dataset_comment: str
    data_lines: tuple[tuple[str, str], ...]  # (line, comment) after the dataset
    model: str
    model_params: dict[str, Any]
    offered: dict[str, Any]                  # what the data offers the model (for the attacks' applicability)
    naive_attack: tuple[str, dict[str, Any]]  # the classic attack every starter runs, at a budget a CPU finishes
    metrics: tuple[str, ...]
    utility: dict[str, Any]


#: The quickstarts' data and models: greyscale digits on the DLG paper's LeNet, PII sentences on a small GPT.
STARTERS = {
    "image": Starter("digits", "scikit-learn's 8x8 digits, offline", (("  image_size: 32", DATA["image_size"].describe()),),
                     "lenet_zhu", {}, {"channels": 1, "num_classes": 10, "image_size": 32},
                     ("inverting_gradients", {"iterations": 1000, "lr": 0.1, "priors": {"tv": 0.01}}),
                     ("psnr", "ssim", "label_accuracy"), {"train_steps": 200}),
    "text": Starter("pii_sentences", "made-up sentences with personal values, generated offline",
                    (("  params: {length: 16}", "tokens per sentence, padding included"),),
                    "tiny_gpt", {"layers": 3}, {"vocab_size": 128, "num_classes": 4, "length": 16},
                    ("tag", {"iterations": 300}), ("rouge1", "rouge2", "token_accuracy", "label_accuracy"),
                    {"train_steps": 100, "batch_size": 32, "lr": 0.001}),
}


def _value(value: Any) -> str:
    """One YAML flow value (``0.1``, ``per_round``, ``[0]``, ``{tv: 0.01}``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=1_000).strip().removesuffix("\n...").strip()


def _line(text: str, comment: str = "") -> str:
    """``text`` with ``comment`` after it, aligned at COMMENT_AT (two spaces after a longer text)."""
    return f"{text:<{max(COMMENT_AT, len(text) + 2)}}# {comment}" if comment else text


def _param_comment(p: Param) -> str:
    return f"{p.help} ({p.describe()})" if p.help else p.describe()


def _params_block(spec: dict[str, Param], given: dict[str, Any], indent: str, others: bool = True) -> list[str]:
    """``params:`` with the given values, then (``others``) every other parameter commented out at its default."""
    lines = [f"{indent}params:" if given else f"{indent}# params:"]
    for key, p in spec.items():
        if key in given:
            lines.append(_line(f"{indent}  {key}: {_value(given[key])}", _param_comment(p)))
        elif others:
            lines.append(_line(f"{indent}  # {key}: {_value(p.default)}", _param_comment(p)))
    return lines if len(lines) > 1 else []


def _required_values(kind: str, name: str, spec: dict[str, Param]) -> dict[str, Any]:
    """The example of each required parameter; a ConfigError naming a required one without an example."""
    missing = [k for k, p in spec.items() if p.required and p.example is None]
    if missing:
        raise ConfigError([f"init: {kind} {name}: required parameter {missing[0]} declares no example "
                           f"(Param(example=...)); write the entry by hand"])
    return {k: p.example for k, p in spec.items() if p.required}


def _checked_names(registry: Registry, kind: str, names: Sequence[str], option: str) -> list[str]:
    known = registry.names(kind)
    bad = [n for n in names if n not in known]
    if bad:
        raise ConfigError([f"init: {option} {bad[0]!r} is not a registered {kind}{did_you_mean(bad[0], known)}; "
                           f"choices: {', '.join(known)}"])
    return list(dict.fromkeys(names))


def _default_attacks(registry: Registry, defenses: list[str], kind: str) -> list[tuple[str, list[str] | None]]:
    """The classic attack on every setting, the Bayes adversary on the defenses with a likelihood, and for each
    defense without one the attacks built on it (each with the defenses it runs on, None: all). For text, every
    text attack that applies to the starter's model runs, the Bayes adversary where the defense declares a
    likelihood."""
    starter = STARTERS[kind]
    attacks: list[tuple[str, list[str] | None]] = [(starter.naive_attack[0], None)]
    built = {n: registry.get("defense", n)(**_required_values("defense", n, registry.get("defense", n).params))
             for n in defenses}
    with_likelihood = [n for n, d in built.items() if d.has_likelihood() and not d.baseline]
    if with_likelihood:  # on the undefended update the classic attack already matches the plain gradient
        attacks += [(a, with_likelihood) for a in registry.names("attack")
                    if registry.get("attack", a).uses_likelihood and registry.get("attack", a).modality == kind]
    if kind == "text":
        return attacks + _text_attacks(registry, starter, built)
    for n, d in built.items():
        if d.has_likelihood():
            continue
        with torch.random.fork_rng(devices=[]):
            model = d.wrap_model(registry.get("model", starter.model).build(**starter.offered))
        for a in registry.names("attack"):
            attack = registry.get("attack", a)()
            if (not attack.uses_likelihood and attack.uses_defense and attack.unsupported_defense(d) is None
                    and attack.unsupported(model, 1, FEDSGD) is None):
                attacks.append((a, [n]))
    return attacks


def _text_attacks(registry: Registry, starter: Any, built: dict) -> list[tuple[str, list[str] | None]]:
    """Every other text attack that applies to the starter's model, each restricted to the defenses whose model it
    applies to (adapter_span refuses a LoRA rank too small for a sentence); one that applies to none is left out."""
    def model(defense: Any = None) -> Any:
        with torch.random.fork_rng(devices=[]):
            plain = registry.get("model", starter.model).build(**starter.offered, **starter.model_params)
            return plain if defense is None else defense.wrap_model(plain)

    base, wrapped = model(), {n: model(d) for n, d in built.items()}
    out: list[tuple[str, list[str] | None]] = []
    for a in registry.names("attack"):
        cls = registry.get("attack", a)
        if a == starter.naive_attack[0] or cls.uses_likelihood or cls.modality != "text" or \
                cls().unsupported(base, 1, FEDSGD) is not None:
            continue
        fits = [n for n, m in wrapped.items() if cls().unsupported(m, 1, FEDSGD) is None]
        if fits:
            out.append((a, None if len(fits) == len(wrapped) else fits))
    return out


def _kind(registry: Registry, defenses: list[str]) -> str:
    """The examples every named defense applies to (images where all do); a ConfigError where none is common."""
    common = [k for k in STARTERS if all(k in registry.get("defense", d).modalities for d in defenses)]
    if not common:
        spread = "; ".join(f"{d}: {', '.join(registry.get('defense', d).modalities)}" for d in defenses)
        raise ConfigError([f"init: the defenses apply to different examples ({spread}); one audit holds one kind"])
    return common[0]


def starter_audit(registry: Registry, defenses: Sequence[str] = (), attacks: Sequence[str] = (),
                  name: str = "my-audit", plugins_dir: str | None = None) -> str:
    """The text of a commented audit: the undefended reference, ``defenses`` (default: gaussian) at their
    parameters' examples, and ``attacks`` (default: the classic attack, the Bayes adversary where a defense
    declares a likelihood, and the attacks built on each defense that declares none); ``plugins_dir`` (relative
    to the file) where the defenses or attacks named come from a drop-in folder."""
    baseline = [n for n in registry.names("defense") if registry.get("defense", n).baseline]
    chosen = _checked_names(registry, "defense", [*baseline[:1], *(defenses or DEFAULT_DEFENSES)], "--defense")
    named = _checked_names(registry, "attack", attacks, "--attack")
    kind = _kind(registry, chosen)
    starter = STARTERS[kind]
    plan = [(a, None) for a in named] if named else _default_attacks(registry, chosen, kind)
    lines = [
        "# A leakaudit audit: which defenses, attacked how, on which data and model.",
        "#   leakaudit validate FILE            checks it (before any work)",
        "#   leakaudit run FILE --out DIR       runs it and writes DIR/report.html",
        "# Every key and its choices: `leakaudit schema`; a plugin's parameters: `leakaudit plugins KIND NAME`.",
        f"name: {_value(name)}",
        *([_line(f"plugins_dir: {_value(plugins_dir)}", TOP["plugins_dir"].help)] if plugins_dir else []),
        _line("seed: 0", TOP["seed"].help),
        _line("device: auto", "auto | cpu | cuda"),
        "data:",
        _line(f"  dataset: {starter.dataset}", f"{starter.dataset_comment}; others: "
                                               f"{', '.join(registry.names('dataset'))}"),
        *(_line(text, comment) for text, comment in starter.data_lines),
        _line("  targets: 4", DATA["targets"].help),
        _line("  batch_size: 1", DATA["batch_size"].help),
        "model:",
        _line(f"  name: {starter.model}", f"{MODEL['name'].help}; or factory: 'package.module:build'"),
        *([_line(f"  params: {_value(starter.model_params)}", MODEL["params"].help)] if starter.model_params else []),
        _line("  checkpoints: [0]", MODEL["checkpoints"].help),
        "# One setting per entry; `sweep: {param: [v1, v2, ...]}` makes one per value: a privacy-utility curve.",
        "defenses:",
    ]
    for d in chosen:
        cls = registry.get("defense", d)
        lines.append(_line(f"  - name: {d}", registry.entries["defense"][d].summary))
        lines += _params_block(cls.params, _required_values("defense", d, cls.params), "    ")
    bayes = "bayes_text" if kind == "text" else "bayes"
    lines += [f"# The classic attack judges like most papers; adaptive attacks ({bayes}: the Bayes-optimal adversary",
              "# built from each defense's likelihood) judge against the strongest attacker that knows the defense.",
              "attacks:"]
    for a, scope in plan:
        cls = registry.get("attack", a)
        lines.append(_line(f"  - name: {a}", f"{registry.entries['attack'][a].summary} Its parameters: "
                                             f"leakaudit plugins attack {a}"))
        # text's other attacks at the budget they declare for a CPU (LAMP's default is a GPU's 2,500 steps)
        budget = cls.auto_params.get("cpu", {}) if kind == "text" else {}
        lines += _params_block(cls.params, starter.naive_attack[1] if a == starter.naive_attack[0] else budget,
                               "    ", others=False)
        if scope:
            lines.append(_line(f"    defenses: {_value(scope)}", "the settings it runs on"))
    lines += [_line(f"utility: {_value(starter.utility)}", "SGD steps that measure each defense's test accuracy"),
              _line(f"metrics: {_value(list(starter.metrics))}", f"choices: {', '.join(registry.names('metric'))}")]
    return "\n".join(lines) + "\n"


def write_starter(path: Path | None, text: str, plugins_dirs: Sequence[str | Path] = ()) -> None:
    """Validate the starter as ``leakaudit validate`` does, then write it (or print it when ``path`` is None)."""
    from leakaudit.evaluator.run.scenario import Scenario, check_scenario

    where = path if path is not None else Path("starter.yaml")
    check_scenario(Scenario(load_audit(where, list(plugins_dirs), text=text)), user_code=False)
    if path is None:
        print(text, end="")
    else:
        path.write_text(text)
