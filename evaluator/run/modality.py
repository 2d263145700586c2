"""The kind of examples an update is computed on: images or text, one object each that the step asks.

A modality says what the attacks rebuild from a batch's inputs (pixels in [0, 1], or token ids as they are), what
one example is called, whether the prior-free corridor, PII recall and the decoy test apply, which metrics a live
audit scores by default and how the guesses made without the update score: the runner, the step and the monitors
ask it instead of branching on "is this text".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from leakaudit.evaluator.audit.specs import DEFAULT_METRICS, DEFAULT_TEXT_METRICS
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.results.verdict import prior_free_bound
from leakaudit.evaluator.zoo.metrics import guess_scores, text_guess_scores
from leakaudit.plugins.components import Metric
from leakaudit.plugins.manager import Registry

PIXEL_SLACK = 0.02  # how far outside [0, 1] denormalised inputs may stray (resampling overshoot) before it is an error

Stats = float | Sequence[float] | Tensor


def channel_stats(value: Stats, channels: int, device: torch.device) -> Tensor:
    """A normalisation statistic as a (C, 1, 1) tensor on ``device`` (one number stands for every channel)."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1, 1, 1)
    return t.expand(channels, 1, 1) if t.numel() == 1 else t


def pixels_of(inputs: Tensor, mean: Stats, std: Stats, caller: str = "audit_batch") -> tuple[Tensor, Tensor, Tensor]:
    """``(pixels in [0, 1], mean, std)`` of normalised ``inputs``, the statistics as (C, 1, 1) tensors on their
    device; a ConfigError when ``inputs * std + mean`` leaves the pixel range (the wrong normalisation)."""
    channels, device = inputs.shape[1], inputs.device
    mean_t, std_t = channel_stats(mean, channels, device), channel_stats(std, channels, device)
    raw = inputs * std_t + mean_t
    lo, hi = float(raw.min()), float(raw.max())
    if lo < -PIXEL_SLACK or hi > 1 + PIXEL_SLACK:
        raise ConfigError([f"{caller}: mean, std: inputs * std + mean spans [{lo:.3g}, {hi:.3g}], not the pixel "
                           "range [0, 1]; pass the mean and std your inputs were normalised with"])
    return raw.clamp(0, 1), mean_t, std_t


@dataclass
class Knowledge:
    """What the attacker guesses from without the update: for images the mean image (or a function of a batch's
    pixels: the mean of what the attacker holds less them) and each target's class mean; for text the most
    frequent token at each position, the vocabulary's size, the padding id and a guess's PII recall."""

    mean_image: Tensor | Callable[[Tensor], Tensor | None] | None = None
    class_mean: Callable[[Tensor, Tensor], Tensor | None] | None = None
    frequent: Tensor | None = None
    vocab_size: int = 0
    pad_id: int = 0
    recall: Callable[[Tensor, int], float | None] | None = None


class Modality:
    """Images: what the attacks rebuild are pixels in [0, 1], bounded by the prior-free corridor, named among
    decoys."""

    name = "image"  # as ModelSpec.modality and Attack.modality say it
    unit = "image"  # one example, in reports and log lines
    decoys = True  # a batch's originals may be named among same-class decoys (verdict.decoy_test)
    normalised = True  # the model reads its inputs normalised (a mean and std to undo)
    personal = False  # its examples may hold personal values (PII recall)

    def attacked(self, inputs: Tensor, stats: Any, caller: str = "audit_batch") -> tuple[Tensor, Tensor, Tensor]:
        """``(what the attacks rebuild and are scored against, mean, std)`` of a batch's ``inputs`` normalised by
        ``stats`` (the mean and std)."""
        mean, std = stats
        return pixels_of(inputs, mean, std, caller=caller)

    def read(self, inputs: Tensor) -> Tensor:
        """A watched batch's inputs as the monitor attacks and scores them."""
        return inputs

    def seen(self, items: Tensor, stats: Any) -> Tensor:
        """The attacker's own items as the attacks see them: pixels in [0, 1] (``stats``: their normalisation)."""
        mean, std = (channel_stats(s, items.shape[1], items.device) for s in stats)
        return (items.float() * std + mean).clamp(0, 1)

    def item_problem(self, shape: tuple[int, ...]) -> str | None:
        """What is wrong with one training input of this ``shape``, None when it is one example."""
        return None if len(shape) == 3 else (f"loader: its items hold inputs of shape {shape}; the attacks rebuild "
                                             "images (C, H, W)")

    def image_size(self, shape: tuple[int, ...] | None) -> int | None:
        """The side the size-bound metrics check, of an input of ``shape`` (None when unknown)."""
        return min(shape[-2:]) if shape else None

    def described(self, model: Any) -> dict[str, Any]:
        """What a monitor's monitor.json says of its examples beside the model (nothing: images are the default)."""
        return {}

    def prior_free(self, mu: float | None, originals: Tensor, confidence: float) -> dict[str, float] | None:
        """The prior-free corridor (Riess et al. 2024) of one row's originals under a ``mu``-GDP update."""
        return prior_free_bound(mu, originals.detach().cpu().numpy(), confidence)

    def recall(self, personal: Callable[[Tensor, Any], float | None], aligned: Tensor, update: Any) -> float | None:
        """The share of personal values ``personal`` finds recovered in a reconstruction: none to find in images."""
        return None

    def guesses(self, metrics: list[Metric], batches: Iterable[tuple[Tensor, Tensor]], knowledge: Knowledge,
                generator: torch.Generator) -> dict[str, dict[str, float | None]]:
        """The scores of guesses made without the update on every batch (the verdict's bar): noise, grey, the mean
        image and the class means (``guess_scores``)."""
        return guess_scores(metrics, batches, knowledge.mean_image, generator, knowledge.class_mean)

    def default_metrics(self, registry: Registry) -> list[str]:
        """A live audit's default metrics: the audit file's that score any image size, since a live model's images
        are seen only at its first batch (a metric with a ``min_size``, as LPIPS, is measured where named)."""
        return [m for m in DEFAULT_METRICS if registry.get("metric", m).min_size <= 1]


class Text(Modality):
    """Token sequences: read as they are (nothing to undo), without a pixel corridor or a decoy test."""

    name = "text"
    unit = "sentence"
    decoys = False  # naming a sentence among decoys: not built for text yet
    normalised = False
    personal = True

    def attacked(self, inputs: Tensor, stats: Any, caller: str = "audit_batch") -> tuple[Tensor, Tensor, Tensor]:
        """Token ids as they are, with no normalisation to undo."""
        device = inputs.device
        return inputs, torch.zeros(1, 1, 1, device=device), torch.ones(1, 1, 1, device=device)

    def read(self, inputs: Tensor) -> Tensor:
        return inputs.long()  # token ids of any integer type, scored as long

    def seen(self, items: Tensor, stats: Any) -> Tensor:
        return items.long()

    def item_problem(self, shape: tuple[int, ...]) -> str | None:
        return None if len(shape) == 1 else f"loader: its items hold token ids of shape {shape}; expected one sequence (T,)"

    def image_size(self, shape: tuple[int, ...] | None) -> int | None:
        return None

    def described(self, model: Any) -> dict[str, Any]:
        """The modality and the padding id, for the report's sentences."""
        return {"modality": "text", "pad_id": getattr(model, "pad_id", 0)}

    def prior_free(self, mu: float | None, originals: Tensor, confidence: float) -> dict[str, float] | None:
        return None  # a bound on pixels' error

    def recall(self, personal: Callable[[Tensor, Any], float | None], aligned: Tensor, update: Any) -> float | None:
        return personal(aligned, update)

    def guesses(self, metrics: list[Metric], batches: Iterable[tuple[Tensor, Tensor]], knowledge: Knowledge,
                generator: torch.Generator) -> dict[str, dict[str, float | None]]:
        """Uniform tokens and the most frequent ones (``text_guess_scores``), with their PII recall where known."""
        assert knowledge.frequent is not None, "a text guess needs the attacker's most frequent tokens"
        return text_guess_scores(metrics, batches, knowledge.frequent, knowledge.vocab_size, generator,
                                 knowledge.pad_id, knowledge.recall)

    def default_metrics(self, registry: Registry) -> list[str]:
        return list(DEFAULT_TEXT_METRICS)


IMAGES, TEXT = Modality(), Text()
MODALITIES = {m.name: m for m in (IMAGES, TEXT)}


def modality_of(name: str) -> Modality:
    """The modality a spec names ("image", "text")."""
    return MODALITIES[name]
