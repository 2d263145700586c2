"""Additive-noise defenses (Gaussian, Laplacian) and the undefended baseline."""
from __future__ import annotations

from typing import Sequence, cast

import torch
from torch import Tensor

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import Defense, DeterministicDefense, PrivacyProfile, SharedUpdate


def gaussian_log_density(residual: Tensor, scale: float) -> Tensor:
    """Elementwise N(0, scale^2) log-density, without the constant -log(scale sqrt(2 pi))."""
    return -residual ** 2 / (2 * scale ** 2)


def laplace_log_density(residual: Tensor, scale: float) -> Tensor:
    """Elementwise Laplace(0, scale) log-density, without the constant -log(2 scale)."""
    return -residual.abs() / scale


def sample_gaussian(like: Tensor, scale: float, generator: torch.Generator) -> Tensor:
    return scale * torch.randn(like.shape, generator=generator, device=like.device, dtype=like.dtype)


def sample_laplace(like: Tensor, scale: float, generator: torch.Generator) -> Tensor:
    """Laplace(0, scale) by inverting the CDF of a uniform draw from ``generator``."""
    u = torch.rand(like.shape, generator=generator, device=like.device, dtype=like.dtype) - 0.5
    return -scale * u.sign() * torch.log1p(-2 * u.abs().clamp(max=0.5 - 1e-7))


NOISE = {"gaussian": (sample_gaussian, gaussian_log_density), "laplace": (sample_laplace, laplace_log_density)}


class NoDefense(DeterministicDefense):
    """Shares the clean update: the reference point of every audit."""

    name = "none"
    baseline = True

    def output_radius(self, radius: float | None) -> float | None:
        return radius


class AdditiveNoise(Defense):
    """Adds i.i.d. noise of the family ``noise``, scaled by the parameter named ``scale_param``."""

    noise: str
    scale_param: str

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        draw, scale = NOISE[self.noise][0], self.settings[self.scale_param]
        return [g + draw(g, scale, generator) for g in update]

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """Sum of the noise's log-densities at the residuals, up to a constant."""
        density, scale = NOISE[self.noise][1], self.settings[self.scale_param]
        return cast(Tensor, sum(density(o - c, scale).sum() for o, c in zip(observed.tensors, candidate)))


class GaussianNoise(AdditiveNoise):
    """Adds independent N(0, sigma^2) noise to every coordinate of the update."""

    name = "gaussian"
    paper = "Balunovic et al. 2022"
    noise, scale_param = "gaussian", "sigma"
    params = {"sigma": Param(type=float, min=0.0, exclusive_min=True, protects="higher", help="noise standard deviation",
                             example=0.1)}
    sigma: float

    def privacy_profile(self, radius: float | None = None) -> PrivacyProfile | None:
        """The Gaussian mechanism: an update of norm at most ``radius`` beside the noise alone is
        ``radius / sigma``-GDP (Dong et al. 2022); without a bound on the norm (no ``clip`` first), none."""
        if radius is None:
            return None
        return PrivacyProfile(mu=radius / self.sigma, mechanism=f"Gaussian mechanism: update norm at most "
                                                                 f"{radius:g} (clip), noise sigma {self.sigma:g}")


class LaplaceNoise(AdditiveNoise):
    """Adds independent Laplace(0, b) noise to every coordinate of the update (variance 2 b^2)."""

    name = "laplace"
    paper = "Balunovic et al. 2022"
    noise, scale_param = "laplace", "scale"
    params = {"scale": Param(type=float, min=0.0, exclusive_min=True, protects="higher", help="Laplace scale b", example=0.05)}
    scale: float


@hookimpl
def register_defenses():
    return [NoDefense, GaussianNoise, LaplaceNoise]
