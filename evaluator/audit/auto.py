"""``attacks: auto``, the default: every registered attack that declares a budget for auto
(``Attack.auto_params``) and applies to one of the audit's settings, run at its budget for the audit's device.

Whether an attack applies is the attack's own declaration (``needs_defense``, ``unsupported_defense``,
``unsupported``, and ``beyond_reach``: where it applies but its measured reach ends), asked of the model each
setting attacks, so that a team gets calibrated verdicts without knowing the literature; ``leakaudit validate``
prints the choice and why each other attack is left out.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from leakaudit.evaluator.audit.checks import data_modality
from leakaudit.evaluator.audit.materials import check_data_memory, initial_model, load_data, model_section
from leakaudit.evaluator.audit.types import AttackSpec, Audit, ConfigError, DefenseSetting, as_dict, call_label
from leakaudit.plugins.attack import Attack
from leakaudit.plugins.components import ImageData
from leakaudit.plugins.defense import Defense
from leakaudit.plugins.protocol import Protocol
from leakaudit.plugins.manager import Registry
from leakaudit.plugins.text import TokenData

AUTO = "auto"


def choose_attacks(audit: Audit, user_code: bool = True) -> tuple[list[AttackSpec], tuple[str, ...]]:
    """The attacks ``attacks: auto`` runs, each restricted to the settings it applies to, and one line per
    registered attack on what was chosen or why not. ``user_code=False`` calls no factory of the user's: the
    settings of a factory model (or of factory data) are then checked on their models when the audit runs."""
    data = _data(audit, user_code)
    models: dict[str, nn.Module | None] = {}

    def why_not(attack: Attack, setting: DefenseSetting) -> str | None:
        return _why_not(attack, setting, audit, data, models, user_code)

    chosen, lines = auto_choice(audit.registry, data_modality(as_dict(audit.data), audit.registry),
                                torch.device(audit.device).type, audit.settings, why_not, str(audit.path))
    if not chosen:
        raise ConfigError([f"{audit.path}: attacks: auto found no registered attack that applies to this audit "
                           f"({'; '.join(lines)}); list the attacks yourself"])
    return chosen, lines


def auto_choice(registry: Registry, modality: str, device_type: str, settings: Sequence[DefenseSetting],
                why_not: Callable[[Attack, DefenseSetting], str | None],
                where: str) -> tuple[list[AttackSpec], tuple[str, ...]]:
    """Every registered attack of ``modality`` at its auto budget for ``device_type`` that ``why_not`` lets run on
    one of ``settings`` at least, restricted to those; and one line per attack on the choice. An audit file and a
    monitor choose through this one rule, each asking of its own models (``why_not``); ``where`` names the one
    asking in the error of a plugin that refuses its own auto_params."""
    chosen, lines = [], []
    for name, entry in sorted(registry.entries["attack"].items()):
        if entry.obj.modality != modality:
            lines.append(f"{name}: left out: it reconstructs {entry.obj.modality}")
            continue
        params = entry.obj.auto_settings(device_type)
        if params is None:
            lines.append(f"{name}: left out: {entry.obj.auto_skip}")
            continue
        attack = _build(entry.obj, name, params, where)
        fits: set[str] = set()
        misfits: dict[str, list[str]] = {}
        for setting in settings:
            why = why_not(attack, setting)
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
    return chosen, tuple(lines)


def _data(audit: Audit, user_code: bool) -> ImageData | TokenData | None:
    """The audit's data, whose shapes the models need; None where it comes from a factory not to be called."""
    if audit.data.factory is not None and not user_code:
        return None
    check_data_memory(audit)
    return load_data(audit)


def _build(cls: type, name: str, params: dict, where: str) -> Attack:
    """The attack at its auto budget; a plugin whose ``auto_params`` it refuses is named in one line."""
    try:
        return cls(**params)
    except Exception as exc:
        raise ConfigError([f"{where}: attacks: auto: attack {name!r} refuses its own auto_params "
                           f"{params!r}: {exc}"]) from None


def _why_not(attack, setting: DefenseSetting, audit: Audit, data: ImageData | TokenData | None,
             models: dict[str, nn.Module | None], user_code: bool) -> str | None:
    """Why ``attack`` cannot run on ``setting``, in the attack's own words; None where it can (or where the
    setting's model is the user's and cannot be built yet)."""
    defense = setting.build(audit.registry)
    return misfit(attack, setting.is_baseline(audit.registry), defense,
                  lambda: _model(audit, setting, defense, data, models, user_code), audit.batch_size_of(setting),
                  audit.protocol_of(setting))


def misfit(attack: Attack, baseline: bool, defense: Defense, model: Callable[[], nn.Module | None], batch_size: int,
           protocol: Protocol) -> str | None:
    """Why ``attack`` cannot run on an update of ``defense`` (``baseline``: the undefended one) from ``model()``
    (built only if the defense lets the attack run; None: not known here), in the attack's own words; None where
    it can."""
    if attack.needs_defense and baseline:
        return f"{attack.name} reads what a defense adds to the model, and the undefended update has nothing"
    why = attack.unsupported_defense(defense)
    if why:
        return why
    built = model()
    if built is None:
        return None
    return attack.unsupported(built, batch_size, protocol) or attack.beyond_reach(built, batch_size, protocol)


def _model(audit: Audit, setting: DefenseSetting, defense, data: ImageData | TokenData | None,
           models: dict[str, nn.Module | None], user_code: bool) -> nn.Module | None:
    """The setting's model at step 0 on the CPU in the file's mode (its shape and mode are what matter), built once
    per setting; None where it cannot be built here (a factory not to be called, or a defense that does not fit
    it, which the audit's checks then report)."""
    key = setting.identity
    if key not in models:
        models[key] = None
        if data is not None and (user_code or ":" not in (model_section(audit, setting).name or "")):
            try:
                model = initial_model(audit, data, defense, setting, torch.device("cpu"))
                models[key] = model.train(model_section(audit, setting).mode == "train")  # as the worker sets it
            except Exception:  # a defense that does not fit the model, or a factory that fails: check_scenario says it
                pass
    return models[key]
