"""Image priors: negative log-probabilities of candidate images, added to attack objectives."""
from __future__ import annotations

from torch import Tensor


def total_variation(images: Tensor) -> Tensor:
    """Anisotropic total variation: mean absolute difference of neighbouring pixels (seed 004, Eq. 4)."""
    dx = (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    dy = (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    return dx + dy
