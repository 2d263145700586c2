"""``attacks: auto``, the default: every registered attack that declares a budget for auto
(``Attack.auto_params``) and applies to one of the audit's settings, run at its budget for the audit's device.

Whether an attack applies is the attack's own declaration (``needs_defense``, ``unsupported_defense``,
``unsupported``), asked of the model each setting attacks, so that a team gets calibrated verdicts without
knowing the literature; ``leakaudit validate`` prints the choice and why each other attack is left out.
"""
from __future__ import annotations

import torch
from torch import nn

from leakaudit.evaluator.audit.checks import data_modality
from leakaudit.evaluator.audit.materials import check_data_memory, initial_model, load_data, model_section
from leakaudit.evaluator.audit.types import AttackSpec, Audit, ConfigError, DefenseSetting, as_dict, call_label
from leakaudit.plugins.components import ImageData

AUTO = "auto"


def choose_attacks(audit: Audit, user_code: bool = True) -> tuple[list[AttackSpec], tuple[str, ...]]:
    """The attacks ``attacks: auto`` runs, each restricted to the settings it applies to, and one line per
    registered attack on what was chosen or why not. ``user_code=False`` calls no factory of the user's: the
    settings of a factory model (or of factory data) are then checked on their models when the audit runs."""
    data = _data(audit, user_code)
    models: dict[str, nn.Module | None] = {}
    chosen, lines = [], []
    for name, entry in sorted(audit.registry.entries["attack"].items()):
        if entry.obj.modality != data_modality(as_dict(audit.data), audit.registry):
            lines.append(f"{name}: left out: it reconstructs {entry.obj.modality}")
            continue
        params = entry.obj.auto_settings(torch.device(audit.device).type)
        if params is None:
            lines.append(f"{name}: left out: {entry.obj.auto_skip}")
            continue
        attack = _build(entry.obj, name, params, audit)
        fits, misfits = set(), {}
        for setting in audit.settings:
            why = _why_not(attack, setting, audit, data, models, user_code)
            if why is None:
                fits.add(setting.identity)
            else:
                misfits.setdefault(why, []).append(setting.key)
        if not fits:
            lines.append(f"{name}: left out: {'; '.join(misfits)}")
            continue
        role = "adaptive" if attack.knows_defense else "naive"
        chosen.append(AttackSpec(name, params, name, role=role, chosen_for=frozenset(fits) if misfits else None))
        lines.append(f"{name}: chosen, {call_label(name, params)}"
                     + "".join(f"; not on {', '.join(keys)}: {why}" for why, keys in misfits.items()))
    if not chosen:
        raise ConfigError([f"{audit.path}: attacks: auto found no registered attack that applies to this audit "
                           f"({'; '.join(lines)}); list the attacks yourself"])
    return chosen, tuple(lines)


def _data(audit: Audit, user_code: bool) -> ImageData | None:
    """The audit's data, whose shapes the models need; None where it comes from a factory not to be called."""
    if audit.data.factory is not None and not user_code:
        return None
    check_data_memory(audit)
    return load_data(audit)


def _build(cls: type, name: str, params: dict, audit: Audit):
    """The attack at its auto budget; a plugin whose ``auto_params`` it refuses is named in one line."""
    try:
        return cls(**params)
    except Exception as exc:
        raise ConfigError([f"{audit.path}: attacks: auto: attack {name!r} refuses its own auto_params "
                           f"{params!r}: {exc}"]) from None


def _why_not(attack, setting: DefenseSetting, audit: Audit, data: ImageData | None,
             models: dict[str, nn.Module | None], user_code: bool) -> str | None:
    """Why ``attack`` cannot run on ``setting``, in the attack's own words; None where it can (or where the
    setting's model is the user's and cannot be built yet)."""
    if attack.needs_defense and setting.is_baseline(audit.registry):
        return f"{attack.name} reads what a defense adds to the model, and the undefended update has nothing"
    defense = setting.build(audit.registry)
    why = attack.unsupported_defense(defense)
    if why:
        return why
    model = _model(audit, setting, defense, data, models, user_code)
    return None if model is None else attack.unsupported(model, audit.batch_size_of(setting),
                                                          audit.protocol_of(setting))


def _model(audit: Audit, setting: DefenseSetting, defense, data: ImageData | None,
           models: dict[str, nn.Module | None], user_code: bool) -> nn.Module | None:
    """The setting's model at step 0 on the CPU (its shape is what matters), built once per setting;
    None where it cannot be built here (a factory not to be called, or a defense that does not fit it, which
    the audit's checks then report)."""
    key = setting.identity
    if key not in models:
        models[key] = None
        if data is not None and (user_code or ":" not in model_section(audit, setting).name):
            try:
                models[key] = initial_model(audit, data, defense, setting, torch.device("cpu"))
            except Exception:  # a defense that does not fit the model, or a factory that fails: check_scenario says it
                pass
    return models[key]
