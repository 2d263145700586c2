"""Pruning defenses: random pruning (optionally with noise) and top-k sparsification."""
from __future__ import annotations

import math
from typing import Any, Sequence, cast

import torch
from torch import Tensor

from leakaudit.defenses.noise import NOISE
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import Defense, DeterministicDefense, SharedUpdate


class RandomPrune(Defense):
    """Zeroes a random ``fraction`` of coordinates, then optionally adds Gaussian or Laplacian noise (Balunovic et al. 2022).

    ``mask: per_round`` draws a new mask every round; ``fixed`` uses one mask for the
    whole run (drawn from ``mask_seed``). ``attacker_knows_mask`` publishes the mask
    with the update (the server then ignores pruned coordinates); otherwise the
    likelihood is the per-coordinate mixture of "pruned" and "kept".
    """

    name = "prune"
    paper = "Balunovic et al. 2022"
    params = {
        "fraction": Param(0.5, float, min=0.0, max=0.99, protects="higher", help="share of coordinates zeroed"),
        "noise": Param("none", str, choices=("none", "gaussian", "laplace"), help="noise added after pruning"),
        "scale": Param(0.0, float, min=0.0, protects="higher", help="noise scale (sigma for gaussian, b for laplace)"),
        "mask": Param("per_round", str, choices=("per_round", "fixed"), help="a fresh random mask every round, or one mask for the whole training"),
        "mask_seed": Param(0, int, min=0, help="seed of the fixed mask"),
        "attacker_knows_mask": Param(False, bool, help="the mask is sent with the update"),
    }
    fraction: float
    noise: str
    scale: float
    mask: str
    mask_seed: int
    attacker_knows_mask: bool

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        if self.noise != "none" and self.scale == 0:
            raise ValueError(f"prune: noise {self.noise!r} needs scale > 0, got {self.scale}")
        if self.noise == "none" and self.scale != 0:
            raise ValueError(f"prune: scale {self.scale} is the noise's scale and noise is 'none'; set noise: gaussian "
                             "or laplace (or scale: 0 for no noise)")

    def _masks(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        if self.mask == "fixed":
            generator = torch.Generator(device=update[0].device).manual_seed(self.mask_seed)
        return [torch.rand(g.shape, generator=generator, device=g.device) >= self.fraction for g in update]

    def apply(self, update: list[Tensor], generator: torch.Generator) -> tuple[list[Tensor], dict[str, Any]]:
        masks = self._masks(update, generator)
        sent = [g * m for g, m in zip(update, masks)]
        if self.noise != "none":
            draw = NOISE[self.noise][0]
            sent = [s + draw(s, self.scale, generator) for s in sent]
        return sent, ({"keep_mask": masks} if self.attacker_knows_mask else {})

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """Known mask: kept coordinates only. Unknown: log(f p(o) + (1 - f) p(o - c)) per coordinate."""
        known = observed.metadata.get("keep_mask")
        total: Tensor | float = 0.0
        for i, (o, c) in enumerate(zip(observed.tensors, candidate)):
            if self.noise == "none":  # without noise the mask is visible: exact zeros
                keep = known[i] if known is not None else o != 0
                total = total - 0.5 * (((o - c) ** 2) * keep).sum()
                continue
            density = NOISE[self.noise][1]
            if known is not None:
                total = total + (density(o - c, self.scale) * known[i]).sum()
            else:
                pruned = math.log(self.fraction) + density(o, self.scale) if self.fraction > 0 else None
                kept = math.log1p(-self.fraction) + density(o - c, self.scale)
                total = total + (kept if pruned is None else torch.logaddexp(pruned, kept)).sum()
        return cast(Tensor, total)  # every update holds a tensor


def top_k_masks(update: Sequence[Tensor], fraction: float) -> list[Tensor]:
    """Per tensor, the largest ``ceil(fraction * size)`` coordinates by magnitude."""
    masks = []
    for g in update:
        k = max(1, math.ceil(fraction * g.numel()))
        threshold = g.detach().abs().flatten().topk(k).values[-1]
        masks.append(g.detach().abs() >= threshold)
    return masks


class TopK(DeterministicDefense):
    """Keeps the largest ``fraction`` of coordinates of every tensor by magnitude, zeroing the rest."""

    name = "topk"
    paper = "Zhu et al. 2019"
    sparsifies = True
    params = {"fraction": Param(0.1, float, min=0.0, max=1.0, exclusive_min=True, protects="lower", help="share of coordinates kept")}
    fraction: float

    def transform(self, update: Sequence[Tensor]) -> list[Tensor]:
        return [g * m for g, m in zip(update, top_k_masks(update, self.fraction))]

    def output_radius(self, radius: float | None) -> float | None:
        return radius  # keeping some coordinates never lengthens the update

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """Zero-noise limit: kept coordinates must match, dropped ones must stay below the smallest kept one."""
        total: Tensor | float = 0.0
        for o, c in zip(observed.tensors, candidate):
            kept = o != 0
            # the smallest kept magnitude (0 where nothing is kept), without data-dependent control flow: the
            # likelihood runs under vmap, one observed update per problem, and on a GPU without a sync
            smallest = torch.where(kept, o.abs(), torch.full_like(o, math.inf)).amin()
            threshold = torch.where(kept.any(), smallest, torch.zeros_like(smallest))
            total = total - 0.5 * (((o - c) ** 2) * kept).sum()
            total = total - 0.5 * (((c.abs() - threshold).clamp_min(0) ** 2) * ~kept).sum()
        return cast(Tensor, total)  # every update holds a tensor


@hookimpl
def register_defenses():
    return [RandomPrune, TopK]
