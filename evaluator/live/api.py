"""Audit from your own training code: one call on a model, loss and batch taken from your loop.

``audit_batch`` shares the batch's update through a defense (or captures the update your own
step function makes), runs the attacks on it and scores the reconstructions, with the same
seeds and code as a YAML audit of the same model, batch and step.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from leakaudit.evaluator.audit.auto import AUTO, auto_choice, misfit
from leakaudit.evaluator.audit.checks import check_attacks, check_metrics, check_modality, expand_defenses
from leakaudit.evaluator.audit.types import AttackSpec, ConfigError, DefenseSetting
from leakaudit.evaluator.audit.jobs import AttackJob
from leakaudit.evaluator.run.modality import Stats, modality_of
from leakaudit.evaluator.run.scenario import round_generators
from leakaudit.evaluator.run.step import Judged, Judging, Update, judge_updates, threat_model
from leakaudit.plugins.attack import AuxiliaryData, Problem, ThreatModel
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.manager import Registry, load_registry
from leakaudit.plugins.protocol import FEDSGD, ClientStep, LossFn, OwnStep, StepFn, opacus_hooks_off



@dataclass
class BatchAudit:
    """One attack's result on one defense setting: scores, and the reconstruction in pixel space."""

    setting: str
    attack: str
    metrics: dict[str, float | None]
    reconstruction: Tensor
    labels: Tensor
    seconds: float


def _normalisation(mean: Stats | None, std: Stats | None, normalize: Any) -> tuple[Stats, Stats] | str:
    """``(mean, std)`` from the arguments or a torchvision ``Normalize``; a one-line problem otherwise."""
    if normalize is not None:
        if mean is not None or std is not None:
            return "normalize: give either normalize or mean and std, not both"
        if not (hasattr(normalize, "mean") and hasattr(normalize, "std")):
            return f"normalize: {type(normalize).__name__} has no mean and std; pass torchvision.transforms.Normalize"
        return normalize.mean, normalize.std
    if mean is None or std is None:
        return ("mean, std: required: the normalisation your inputs went through (inputs * std + mean are the "
                "pixels in [0, 1]; mean=0, std=1 for raw pixels), or normalize=torchvision.transforms.Normalize(...)")
    return mean, std


def _changes_architecture(defense, model: nn.Module) -> bool:
    """Whether ``wrap_model`` would change the model, tried on a copy so the caller's model stays as it is."""
    trial = copy.deepcopy(model)
    wrapped = defense.wrap_model(trial)
    return bool(defense.model_changes) or [type(m) for m in wrapped.modules()] != [type(m) for m in model.modules()]


def audit_batch(model: nn.Module, loss_fn: LossFn, inputs: Tensor, labels: Tensor, *,
                defense: str | dict[str, Any] = "none",
                attacks: Sequence[str | dict[str, Any]] = ("inverting_gradients",),
                mean: Stats | None = None, std: Stats | None = None, normalize: Any = None,
                step_fn: StepFn | None = None, lr: float | None = None, known_labels: bool = False,
                metrics: Sequence[str] | None = None, seed: int = 0, step: int = 0, batch_index: int = 0,
                plugins_dirs: Sequence[str] = ()) -> list[BatchAudit]:
    """Attack the update this batch makes on ``model`` as it is now and score what comes back.

    Args:
        model: the model at its current weights; never changed.
        loss_fn: the training loss, ``loss_fn(outputs, labels)``.
        inputs: what the model consumes: images, where ``inputs * std + mean`` are the pixels in [0, 1] the
            attacks rebuild, or token ids ``(N, length)`` of a language model (a
            ``leakaudit.plugins.text.TokenModel``), read as they are and scored by the text metrics.
        labels: the batch's labels.
        defense: the name or mapping of a YAML audit's ``defenses`` entry (a sweep gives one result per setting).
        attacks: the names or mappings of ``attacks`` entries.
        mean: the images' normalisation (0 for raw pixels); not for token ids.
        std: the images' normalisation (1 for raw pixels); not for token ids.
        normalize: the torchvision ``Normalize`` your images went through, in place of ``mean`` and ``std``.
        step_fn: ``step_fn(model, inputs, labels)``: your own training step; the update is the one it makes
            (``protocol: step``), and the model is left as it was.
        lr: ``step_fn``'s SGD learning rate.
        known_labels: give the attacker the labels.
        metrics: the scores to compute (default: the audit file's defaults for the inputs' kind).
        seed: with ``step`` and ``batch_index``, the noise and attack starts of target batch ``batch_index``
            at checkpoint ``step`` of a YAML audit with this seed, so that the two give the same numbers.
        step: see ``seed``.
        batch_index: see ``seed``.
        plugins_dirs: drop-in folders of plugin modules.

    Returns:
        One result per defense setting and attack: its scores, the reconstruction and the recovered labels.

    Raises:
        ConfigError: one line per problem, before any work.

    Example:
        results = leakaudit.audit_batch(model, torch.nn.functional.cross_entropy, images, labels,
                                        attacks=["inverting_gradients"], mean=0.5, std=0.25)
        print(results[0].metrics["psnr"])
    """
    given = [n for n, v in (("mean", mean), ("std", std), ("normalize", normalize)) if v is not None]
    if inputs.is_floating_point():
        stats: tuple[Stats, Stats] | str = _normalisation(mean, std, normalize)
    else:  # token ids: read as they are
        stats = (0.0, 1.0) if not given else f"{', '.join(given)}: token ids are read as they are; leave them out"
    with opacus_hooks_off(model) as plain:
        return _audit(plain, loss_fn, inputs, labels, defense, attacks, stats, step_fn, lr, known_labels,
                      metrics, (seed, step, batch_index), plugins_dirs)


@dataclass
class Prepared:
    """A validated audit of a live model: the defense settings built, the attack specs and the scorers."""

    registry: Any
    defenses: list[tuple[DefenseSetting, Any]]
    specs: list[AttackSpec]
    scorers: list[Any]
    choice: tuple[str, ...] = ()  # attacks: auto's lines, as validate prints them (empty for a list of attacks)

    @property
    def attack_entries(self) -> list[dict[str, Any]]:
        """The attacks as audit-file entries (``attacks: auto``'s choice written out)."""
        return [{"name": s.name, "params": dict(s.params)} for s in self.specs]


def live_metrics(registry: Registry, modality: str = "image") -> list[str]:
    """A live audit's default metrics: the modality's (``Modality.default_metrics``)."""
    return modality_of(modality).default_metrics(registry)


def prepare(model: nn.Module, defense, attacks, metrics: Sequence[str] | None, protocol, batch_size: int,
            image_size: int | None, plugins_dirs, problems: list[str], caller: str = "audit_batch",
            scope: str = "the step you pass", modality: str = "image",
            refused: list[tuple[str, str]] | None = None) -> Prepared:
    """Check a live model's audit before any work: names, scopes, the examples (``modality``) each attack, defense
    and metric applies to, and what each attack and defense supports. Raises ConfigError, one line per problem
    (``problems`` holds those the caller found), prefixed ``caller``. Given ``refused`` (a monitor, whose training
    must go on), a listed attack that cannot apply to the model or the defense is left out, its label and reason
    added there, unless none is left."""
    registry = load_registry(list(plugins_dirs))
    metrics = live_metrics(registry, modality) if metrics is None else metrics
    entry = {"name": defense} if isinstance(defense, str) else defense
    settings = expand_defenses([entry], registry, problems, protocol)
    auto = attacks == AUTO
    specs = [] if auto else check_attacks([{"name": a} if isinstance(a, str) else a for a in attacks], registry,
                                          problems, None)
    problems += [] if auto else [f"attacks[{i}].checkpoints: {caller} attacks {scope}; leave checkpoints out"
                                 for i, item in enumerate(attacks) if isinstance(item, dict) and "checkpoints" in item]
    check_metrics(list(metrics), registry, problems, image_size)
    problems += [f"attacks: {s.label}: tune needs the attacker's own images; tune in a YAML audit" for s in specs if s.tune]
    problems += [f"defense: {s.key}: model: {caller} attacks the model you pass; leave model out"
                 for s in settings if s.model is not None]
    mismatched: list[str] = []
    check_modality(modality, {}, {}, settings, specs, list(metrics), registry, mismatched,
                   holds=f"the inputs are {modality}")
    if mismatched:  # an attack of the other kind of examples could not be asked about the model below
        problems += [p.replace("defenses (", "defense (", 1) for p in mismatched]
        raise ConfigError([f"{caller}: {p.replace('defenses[0]', 'defense')}" for p in problems])
    defenses = [(s, s.build(registry).under(protocol)) for s in settings]
    choice: tuple[str, ...] = ()
    if auto:
        specs, choice = live_choice(registry, model, defenses, batch_size, protocol, modality, caller)
        problems += [] if specs else [f"attacks: auto found no registered attack that applies here "
                                      f"({'; '.join(choice)}); list the attacks yourself"]
    problems += [f"defense: {s.key}: changes the architecture ({'; '.join(d.model_changes) or 'wrap_model'}); "
                 "build your model with it, or audit from YAML" for s, d in defenses if _changes_architecture(d, model)]
    unfit = {a.label: why for a in specs
             if (why := a.build(registry).unsupported(model, batch_size, protocol)
                 or next(filter(None, (a.build(registry).unsupported_defense(d) for setting, d in defenses
                                       if a.applies_to(setting))), None))}
    if refused is not None and len(unfit) < len(specs):  # the others run; these are recorded as they fail
        refused += unfit.items()
        specs = [a for a in specs if a.label not in unfit]
    else:
        problems += [f"attacks: {label}: {why}" for label, why in unfit.items()]
    if problems:
        raise ConfigError([f"{caller}: {p.replace('defenses[0]', 'defense')}" for p in problems])
    return Prepared(registry, defenses, specs, [registry.get("metric", m) for m in metrics], choice)


def live_choice(registry: Registry, model: nn.Module, defenses: list[tuple[DefenseSetting, Any]], batch_size: int,
                protocol, modality: str, caller: str) -> tuple[list[AttackSpec], tuple[str, ...]]:
    """``attacks: auto`` on a live model: the audit file's rule (``auto_choice``: each registered attack at its
    budget for the model's device, where its own declarations let it run), asked of this model and defense."""
    built = {s.identity: d for s, d in defenses}
    device_type = next(model.parameters()).device.type

    def why_not(attack, setting: DefenseSetting) -> str | None:
        return misfit(attack, setting.is_baseline(registry), built[setting.identity], lambda: model, batch_size,
                      protocol)

    return auto_choice(registry, modality, device_type, [s for s, _ in defenses], why_not, caller)


def named_problems(defense: Any, attacks: Any, metrics: Sequence[str] | None, plugins_dirs: Sequence[str]) -> list[str]:
    """What is wrong with a monitor's names and parameters (defense, attacks, metrics), one line each: what can be
    checked before the model and the loop are known, so that a misspelt attack fails where the monitor is made."""
    registry, problems = load_registry(list(plugins_dirs)), list[str]()
    expand_defenses([{"name": defense} if isinstance(defense, str) else defense], registry, problems, None)
    if attacks != AUTO:
        check_attacks([{"name": a} if isinstance(a, str) else a for a in attacks], registry, problems, None)
    if metrics is not None:
        check_metrics(list(metrics), registry, problems)
    return [p.replace("defenses[0]", "defense") for p in problems]


def live_threat(model: nn.Module, loss_fn: LossFn, pixels: Tensor, labels: Tensor, mean: Tensor, std: Tensor,
                defense, known_labels: bool, protocol, auxiliary: AuxiliaryData | None = None) -> ThreatModel:
    """The server's knowledge of a live model and a batch of ``pixels`` in [0, 1] normalised by ``mean``, ``std``
    (its classes counted by one forward pass); token ids (integers) are read as they are. ``auxiliary``: the
    attacker's own data, for the attacks that learn from it."""
    with torch.no_grad():
        num_classes = model((pixels if not pixels.is_floating_point() else (pixels - mean) / std)[:1]).shape[1]
    return threat_model(model, loss_fn, tuple(pixels.shape[1:]), mean, std, num_classes, len(pixels), defense, labels,
                        known_labels, pixels.device, protocol, auxiliary)


def attack_shared(prepared: Prepared, setting: DefenseSetting, defense_obj, observed: SharedUpdate, model: nn.Module,
                  loss_fn: LossFn, pixels: Tensor, labels: Tensor, mean: Tensor, std: Tensor, known_labels: bool,
                  protocol, attack_gen: Callable[[], torch.Generator], checkpoint: int, judging: Judging,
                  auxiliary: AuxiliaryData | None = None, failed: list[tuple[Update, str]] | None = None,
                  ) -> list[Judged]:
    """Judge one shared update (the step) with every attack of ``setting``, each alone, against ``pixels``: the
    attacks see ``model`` at the weights the update was computed at, and each starts from ``attack_gen()``. With
    ``failed``, an attack that raises is listed there (its error on one line) and the others still run, as a
    monitor must: watching a training never fails it; without, the error propagates."""
    threat = live_threat(model, loss_fn, pixels, labels, mean, std, defense_obj, known_labels, protocol, auxiliary)
    groups = ([Update(AttackJob(setting, spec, checkpoint, 0),  # as the runner; each built as its turn comes
                      Problem(observed, threat, attack_gen(), spec.build(prepared.registry)), pixels, labels,
                      list(range(len(pixels))))]
              for spec in prepared.specs if spec.applies_to(setting))
    return judge_updates(groups, judging, failed=failed)


def _audit(model, loss_fn, inputs, labels, defense, attacks, stats: tuple[Stats, Stats] | str, step_fn, lr,
           known_labels, metrics, draws: tuple[int, int, int], plugins_dirs) -> list[BatchAudit]:
    protocol = FEDSGD if step_fn is None else OwnStep(function=step_fn, lr=lr)
    problems = _check_call(step_fn, lr, inputs, labels) + ([stats] if isinstance(stats, str) else [])
    modality = modality_of("image" if inputs.is_floating_point() else "text")
    prepared = prepare(model, defense, attacks, metrics, protocol, len(inputs),
                       min(inputs.shape[-2:]) if inputs.dim() == 4 else None, plugins_dirs, problems,
                       modality=modality.name)
    pixels, mean_t, std_t = modality.attacked(inputs, stats)
    seed, step, index = draws
    judging = Judging(prepared.scorers, modality)
    results = []
    for setting, defense_obj in prepared.defenses:
        share_gen, _ = round_generators(inputs.device, seed, setting.identity, step, index)
        observed = defense_obj.share(ClientStep(model, loss_fn, inputs, labels, share_gen, protocol))
        results += [BatchAudit(setting.key, j.update.job.attack.label, j.scores.values,
                               j.reconstruction.images[j.scores.order], j.reconstruction.labels,
                               j.reconstruction.seconds)
                    for j in attack_shared(  # the same start for every attack
                        prepared, setting, defense_obj, observed, model, loss_fn, pixels, labels, mean_t, std_t,
                        known_labels, protocol,
                        lambda: round_generators(inputs.device, seed, setting.identity, step, index)[1], step, judging)]
    return results


def _check_call(step_fn: Callable | None, lr: float | None, inputs: Tensor, labels: Tensor) -> list[str]:
    problems = []
    if step_fn is not None and (lr is None or lr <= 0):
        problems.append(f"lr: {lr!r}; with step_fn give the SGD step size your step uses (a number > 0)")
    if step_fn is None and lr is not None:
        problems.append("lr: only applies with step_fn")
    if inputs.dim() != (4 if inputs.is_floating_point() else 2):
        problems.append(f"inputs: shape {tuple(inputs.shape)} of {inputs.dtype}; expected images (N, C, H, W) or token "
                        "ids (N, length) of an integer dtype")
    if len(labels) != len(inputs):
        problems.append(f"labels: {len(labels)} labels for {len(inputs)} inputs")
    return problems
