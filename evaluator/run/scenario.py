"""The audited world built from an audit file: data, targets, models, defenses and seeds."""
from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leakaudit.attacks.vectorised import autocast_steps, compile_steps
from leakaudit.evaluator.audit.materials import check_data_memory, initial_model, load_data, model_section, one_line
from leakaudit.evaluator.audit.seeds import derive_seed, generator
from leakaudit.evaluator.audit.types import AttackSpec, Audit, ConfigError, DefenseSetting, ModelSection
from leakaudit.evaluator.zoo.text import pii_recall
from leakaudit.evaluator.run.modality import Modality, modality_of
from leakaudit.evaluator.run.step import threat_model
from leakaudit.plugins.attack import AuxiliaryData, ThreatModel
from leakaudit.plugins.components import ImageData
from leakaudit.plugins.defense import Defense
from leakaudit.plugins.protocol import Protocol
from leakaudit.plugins.text import TokenData, next_token_loss


def round_generators(device: torch.device, seed: int, setting_key: str, checkpoint: int, index: int,
                     purpose: str = "") -> tuple[torch.Generator, torch.Generator]:
    """The defense's noise and the attack's start for one batch at one checkpoint.

    The attack is not part of either seed: every attack (and every trial of a search)
    sees the same update and starts from the same point, so attacks are compared on paired runs.
    """
    return (generator(device, seed, f"{purpose}share", setting_key, checkpoint, index),
            generator(device, seed, f"{purpose}attack", setting_key, checkpoint, index))


def write_cached(path: Path, value: Any) -> None:
    """Write a cache file as JSON, atomically and at best effort: an unwritable cache folder only costs the next
    run the work the file would have saved."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(path)
    except OSError:
        pass


def cache_root() -> Path:
    """What leakaudit keeps between runs (architecture analyses, compiled steps): ``$LEAKAUDIT_CACHE``, else the
    user's cache folder."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "leakaudit"
    return Path(os.environ.get("LEAKAUDIT_CACHE") or home)


def process_flags(audit: Audit) -> Callable[[], None]:
    """The process-wide switches an audit sets, before the process first touches CUDA; returns what restores them.

    ``deterministic: true`` on CUDA: deterministic cuDNN and cuBLAS kernels (cuBLAS reads its workspace setting
    once), so the same file gives the same numbers. Without them two runs of one audit on an H100 differed by up
    to 0.8 dB per image; with them, not at all, at several times the run time (docs/results.md). A CPU is
    deterministic either way; ``deterministic: false`` on CUDA lets cuDNN time its algorithms and keep the fastest.
    ``compile: true``: the attacks' vectorised iterations through torch.compile, on CUDA captured as CUDA graphs and
    replayed, its disk cache kept beside the architecture analyses (``$LEAKAUDIT_CACHE/inductor``). ``precision:
    bfloat16``: those iterations' model passes under autocast."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    if audit.compile:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    restore_precision = autocast_steps(audit.precision)  # first: it refuses an unknown precision
    restore_compile = compile_steps(audit.compile, cuda_graphs=audit.device == "cuda")

    def restore() -> None:
        """Put the process's flags back as they were (a caller's own code is not left in deterministic mode); only
        those that changed: setting the flag imports torch's compiler, 1.3 s at the end of every CPU run."""
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != before[:2]:
            torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
        restore_compile()
        restore_precision()

    if audit.device == "cuda" and audit.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
    elif audit.device == "cuda":  # cuDNN times its algorithms on the first call of each shape and keeps the fastest
        torch.backends.cudnn.benchmark = True
    return restore


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Softmax cross-entropy; ``targets`` are class indices or (soft) label distributions; a language model's
    next-token logits ``(B, vocab, T)`` are scored by ``next_token_loss`` (the positions with a target)."""
    return next_token_loss(logits, targets) if logits.dim() == 3 else F.cross_entropy(logits, targets)


class Scenario:
    """Everything the runner needs, derived deterministically from one audit."""

    def __init__(self, audit: Audit):
        self.audit = audit
        self.device = audit.torch_device()

    @cached_property
    def data(self) -> ImageData | TokenData:
        data, section = load_data(self.audit), self.audit.data
        split = section.target_split
        available = len(data.test_x if split == "test" else data.train_x) - self.audit.target_offset
        if available < section.targets:
            raise ConfigError([f"{self.audit.path}: data.targets: {section.targets} targets requested but "
                               f"the data has only {available} {split} images"])
        return data

    @property
    def _target_split(self) -> tuple[Tensor, Tensor]:
        """The images and labels of the split the targets come from (``data.target_split``)."""
        if self.audit.data.target_split == "train":
            return self.data.train_x, self.data.train_y
        return self.data.test_x, self.data.test_y

    @cached_property
    def target_indices(self) -> Tensor:
        """Indices, in the target split, of the images attacked: its first ones, or a draw from the audit seed (from
        ``Audit.target_offset`` on: fresh targets, past the searched ones, for a frontier's confirmation)."""
        return self._target_order(self.audit.target_offset + self.audit.data.targets)[
            self.audit.target_offset:]

    def _target_order(self, count: int) -> Tensor:
        """The first ``count`` indices of the target split in the audit's order of targets."""
        if self.audit.data.target_order == "first":
            return torch.arange(count)
        gen = torch.Generator().manual_seed(derive_seed(self.audit.seed, "targets"))
        return torch.randperm(len(self._target_split[0]), generator=gen)[:count]

    @cached_property
    def tuning_indices(self) -> Tensor:
        """Training-split images the attacker tunes on (its own data), drawn once from the audit seed; never a
        target (searched or fresh)."""
        gen = torch.Generator().manual_seed(derive_seed(self.audit.seed, "tuning"))
        order = torch.randperm(len(self.data.train_x), generator=gen)
        if self.audit.data.target_split == "train":
            order = order[~torch.isin(order, self._target_order(self.audit.target_offset + self.audit.data.targets))]
        return order

    def batch_size(self, setting: DefenseSetting | None = None) -> int:
        """Images in one update: of ``setting`` (its own number of clients), else of the audit."""
        return self.audit.data.batch_size if setting is None else self.audit.batch_size_of(setting)

    def _batch_of(self, order: Tensor, index: int, setting: DefenseSetting | None) -> Tensor:
        b = self.batch_size(setting)
        return order[index * b:(index + 1) * b]

    def target_ids(self, index: int, setting: DefenseSetting | None = None) -> Tensor:
        """Target-split indices of target batch ``index`` (of ``setting``'s batch size, else the audit's)."""
        return self._batch_of(self.target_indices, index, setting)

    def target_batch(self, index: int, setting: DefenseSetting | None = None) -> tuple[Tensor, Tensor]:
        """Batch ``index`` of private images (pixel space) and labels, on the device."""
        idx = self.target_ids(index, setting)
        x, y = self._target_split
        return x[idx].to(self.device), y[idx].to(self.device)

    def tuning_batch(self, index: int, setting: DefenseSetting | None = None) -> tuple[Tensor, Tensor]:
        """Batch ``index`` of the attacker's own tuning images, drawn from the training split."""
        idx = self._batch_of(self.tuning_indices, index, setting)
        return self.data.train_x[idx].to(self.device), self.data.train_y[idx].to(self.device)

    @property
    def text(self) -> bool:
        """Whether the examples are token sequences (no normalisation, no pixel box)."""
        return self.data.modality == "text"

    @property
    def modality(self) -> Modality:
        """The examples' modality (images, text), which the step asks."""
        return modality_of(self.data.modality)

    @cached_property
    def mean(self) -> Tensor:
        return torch.zeros(1, 1, 1, device=self.device) if isinstance(self.data, TokenData) \
            else self.data.mean.view(-1, 1, 1).to(self.device)

    @cached_property
    def std(self) -> Tensor:
        return torch.ones(1, 1, 1, device=self.device) if isinstance(self.data, TokenData) \
            else self.data.std.view(-1, 1, 1).to(self.device)

    def normalise(self, pixels: Tensor) -> Tensor:
        """What the model reads: normalised pixels, or token ids as they are."""
        return pixels if self.text else (pixels - self.mean) / self.std

    def pii_recall(self, recovered: Tensor, indices: list[int]) -> float | None:
        """The share of the personal values in the target-split sentences ``indices`` that ``recovered`` (their
        reconstructions, in the same order) holds verbatim; None where the dataset marks none in them."""
        data = self.data
        assert isinstance(data, TokenData), "personal values are marked in sentences"
        personal = data.test_pii if self.audit.data.target_split == "test" else data.train_pii
        if not personal:
            return None
        return pii_recall([data.decode(r) for r in recovered], [personal[i] for i in indices])

    def denormalise(self, inputs: Tensor) -> Tensor:
        return inputs if self.text else inputs * self.std + self.mean

    def defense(self, setting: DefenseSetting) -> Defense:
        """The setting's defense as it runs under the setting's protocol (``Defense.under``)."""
        return setting.build(self.audit.registry).under(self.protocol(setting))

    def attack(self, spec: AttackSpec, params: dict | None = None):
        """The attack object, with ``params`` (a tuned setting) in place of the audit's when given."""
        return spec.build(self.audit.registry, params)

    def model_section(self, setting: DefenseSetting | None = None) -> ModelSection:
        """The ``model:`` section a setting uses: its own, or the audit's."""
        return model_section(self.audit, setting)

    def fresh_model(self, defense: Defense, setting: DefenseSetting | None = None,
                    device: torch.device | None = None) -> nn.Module:
        """The model at training step 0 under ``defense`` (``initial_model``), on ``device`` (the audit's by
        default)."""
        return initial_model(self.audit, self.data, defense, setting, self.device if device is None else device)

    def threat(self, model: nn.Module, defense: Defense, labels: Tensor,
               setting: DefenseSetting | None = None) -> ThreatModel:
        """What the attacker knows of one update of ``setting`` (its batch size and protocol, else the audit's)."""
        return threat_model(model, loss_fn, tuple(self.data.test_x.shape[1:]), self.mean, self.std,
                            self.data.num_classes, self.batch_size(setting), defense, labels,
                            self.audit.threat.known_labels, self.device, self.protocol(setting), self.auxiliary)

    def decoys(self) -> tuple[Tensor, Tensor] | None:
        """Images of the target split that no update holds, with their labels, for the identification test of a
        batch (``verdict.decoy_test``): up to ``MAX_DECOYS`` drawn from the audit seed, fewer where each would
        exceed ``DECOY_BYTES`` in all; None where no setting sends more than one image or identification is off."""
        audit = self.audit
        if audit.verdict.identifiable is None or all(audit.batch_size_of(s) == 1 for s in audit.settings) \
                or not self.modality.decoys:
            return None
        x, y = self._target_split
        free = torch.ones(len(x), dtype=torch.bool)
        free[self.target_indices] = False
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(derive_seed(audit.seed, "decoys")))
        order = order[free[order]]
        count = min(len(order), MAX_DECOYS, max(1, DECOY_BYTES // (x[0].numel() * 4)))
        if count == 0:
            return None
        pick = order[:count]
        return x[pick].float(), y[pick]

    @cached_property
    def auxiliary(self) -> AuxiliaryData:
        """The attacker's own images: the training split without the targets (the tuning images' pool)."""
        return AuxiliaryData(self.data.train_x, self.data.train_y, self.tuning_indices)

    def protocol(self, setting: DefenseSetting | None = None) -> Protocol:
        """The protocol of ``setting``'s updates (its own number of clients), else the audit's."""
        return self.audit.protocol if setting is None else self.audit.protocol_of(setting)


#: The most decoys kept for identifying batches, and the most bytes they may take.
MAX_DECOYS = 512
DECOY_BYTES = 64 * 2 ** 20


def untried_attacks(scenario: Scenario) -> str:
    """The registered attacks that bring what gradient matching lacks (``Attack.brings``), apply to the audit's
    first setting at their defaults, within their measured reach, and did not run, each with what it brings ("" when
    none): the report's advice where even the undefended update resists every attack the audit ran."""
    audit = scenario.audit
    setting = audit.settings[0]
    model = scenario.fresh_model(scenario.defense(setting), setting, torch.device("cpu"))  # its shape is enough
    ran = {a.name for a in audit.attacks}
    found = []
    for name, entry in sorted(audit.registry.entries["attack"].items()):
        if not getattr(entry.obj, "brings", "") or name in ran or entry.obj.modality != scenario.data.modality:
            continue
        attack, batch, protocol = entry.obj(), audit.batch_size_of(setting), audit.protocol_of(setting)
        if attack.unsupported(model, batch, protocol) is None and attack.beyond_reach(model, batch, protocol) is None:
            found.append(f"{name} ({entry.obj.brings})")
    return "; ".join(found)


def check_scenario(scenario: Scenario, user_code: bool = True) -> None:
    """Checks that need the data and a built model (targets fit the test split, attacks apply); before any work.

    ``user_code=False`` (``leakaudit validate``) calls no factory of the user's: a data factory skips
    these checks, and settings on a factory model skip the model's; ``run`` makes them all at its start.
    """
    audit = scenario.audit
    if audit.data.factory is not None and not user_code:
        return
    check_data_memory(audit)
    _load(scenario)
    problems = _tuning_images_problems(scenario)
    reasons: dict[tuple[int, str], list[str]] = {}  # (attack, why) -> settings it fails on
    for setting in audit.settings:
        section = scenario.model_section(setting)
        if ":" in (section.name or "") and not user_code:
            continue
        defense = scenario.defense(setting)
        try:
            model = scenario.fresh_model(defense, setting)
        except ValueError as exc:  # the defense does not fit the model (an unknown layer name)
            problems.append(f"{audit.path}: defenses: {setting.key}: {exc}")
            continue
        except Exception as exc:  # the user's factory failed or returned something else
            where = "model" if setting.model is None else f"defenses: {setting.key}: model"
            raise ConfigError([f"{audit.path}: {where}: {section.name}: {one_line(exc)}"]) from None
        for i, spec in enumerate(audit.attacks):
            attack = scenario.attack(spec)
            why = spec.applies_to(setting) and (
                attack.unsupported(model, audit.batch_size_of(setting), audit.protocol_of(setting))
                or attack.unsupported_defense(defense))
            if why:
                reasons.setdefault((i, why), []).append(setting.key)
    for (i, why), keys in reasons.items():
        scope = sum(audit.attacks[i].applies_to(s) for s in audit.settings)
        where = "" if len(keys) == scope else f"on {', '.join(keys)}: "
        problems.append(f"{audit.path}: attacks[{i}]: {where}{why}")
    if problems:
        raise ConfigError(problems)


def _tuning_images_problems(scenario: Scenario) -> list[str]:
    """A search whose tuning batches need more training images than are left once the targets are taken."""
    audit, left = scenario.audit, len(scenario.tuning_indices)
    out = []
    largest = max((audit.batch_size_of(s) for s in audit.settings), default=audit.data.batch_size)
    for i, spec in enumerate(audit.attacks):
        need = spec.tune.targets * largest if spec.tune else 0
        if spec.tune and need > left:
            taken = (f" ({audit.data.targets} are targets: data.target_split is train)"
                     if audit.data.target_split == "train" else "")
            out.append(f"{audit.path}: attacks[{i}].tune.targets: {spec.tune.targets} tuning batches of "
                       f"{largest} need {need} training images; {left} are left to tune on{taken}; "
                       "lower tune.targets or data.targets")
    return out


def _load(scenario: Scenario) -> None:
    """Load the data (a loader's failure, or too few test images, is a ConfigError)."""
    _ = scenario.target_indices


