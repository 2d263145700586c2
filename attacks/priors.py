"""Image priors: penalties (negative log-priors up to scale) on candidate images, combined as a weighted list.

Attacks take ``priors: {name: weight, ...}`` in YAML; images are in the model's
normalised space, with the threat model's box bounds for the pixel-range prior.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

from torch import Tensor


def total_variation(images: Tensor) -> Tensor:
    """Anisotropic total variation: mean absolute difference of neighbouring pixels (Geiping et al. 2020, Eq. 4)."""
    dx = (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    dy = (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    return dx + dy


def total_variation_isotropic(images: Tensor, eps: float = 1e-8) -> Tensor:
    """Isotropic total variation: mean gradient magnitude sqrt(dx^2 + dy^2) (Rudin, Osher, Fatemi)."""
    dx = images[..., :-1, 1:] - images[..., :-1, :-1]
    dy = images[..., 1:, :-1] - images[..., :-1, :-1]
    return (dx ** 2 + dy ** 2 + eps).sqrt().mean()


def l2_norm(images: Tensor) -> Tensor:
    """Mean squared value of the (normalised) image: a Gaussian prior centred on the data mean."""
    return (images ** 2).mean()


def pixel_range(images: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Mean squared excursion outside the valid pixel box [low, high]."""
    return ((low - images).clamp_min(0) ** 2 + (images - high).clamp_min(0) ** 2).mean()


PRIORS: dict[str, Callable[..., Tensor]] = {
    "tv": total_variation,
    "tv_iso": total_variation_isotropic,
    "l2": l2_norm,
    "range": pixel_range,
}


def check_priors(weights: Mapping[str, float]) -> None:
    """Raise ValueError naming an unknown prior or a negative weight."""
    for name, w in weights.items():
        if name not in PRIORS:
            raise ValueError(f"unknown prior {name!r}; choices: {', '.join(PRIORS)}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"prior {name!r}: weight {w!r} must be a finite number >= 0")


def prior_penalty(images: Tensor, weights: Mapping[str, float], low: Tensor, high: Tensor) -> Tensor | float:
    """Weighted sum of the chosen priors (0 when none is chosen)."""
    total: Tensor | float = 0.0
    for name, w in weights.items():
        if w:
            fn = PRIORS[name]
            total = total + w * (fn(images, low, high) if name == "range" else fn(images))
    return total
