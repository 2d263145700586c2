"""Flower's differential privacy as a team switches it on: LocalDpMod, and the fixed and adaptive clipping of the
DifferentialPrivacy{ClientSide,ServerSide}{Fixed,Adaptive}Clipping strategies (Flower 1.42, ``leakaudit[flower]``).

The update is computed by Flower's own functions (``flwr.supercore.differential_privacy``: the clip of the model's
change, the Gaussian noise and its standard deviation), called on the update as arrays with the server's weights
at zero, so that what leaves is exactly what Flower makes of it; Flower draws its noise from NumPy's global
generator, which is seeded from the round's generator for the call and put back after it. Each likelihood is the
Gaussian of that noise around the clipped candidate update, so ``bayes`` attacks it with its exact p(g|x).

Each guarantee is the one the configuration really gives, not the one it names: the clip bounds the update's norm,
so one release is ``clipping_norm / std``-GDP (Dong et al. 2022), whatever ``sensitivity`` or ``epsilon`` say; its
mechanism text (the report's privacy table) gives the epsilon per round and over the rounds and warns where the
noise is orders of magnitude under the update it hides or the epsilon is past any meaningful range (FLIP's
defaults, londonaicentre/FLIP #833: sensitivity 1e-4 beside clipping_norm 1.0, a std of 5e-5).

Flower is imported where it is used; without it, each defense is refused in one line naming the extra.
"""
from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from importlib.util import find_spec
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import Defense, PrivacyProfile, SharedUpdate, squared_distance
from leakaudit.plugins.protocol import FedAvg, Protocol

#: Past this epsilon per round a guarantee says nothing an attacker would notice (e^10: odds moved 22,000-fold).
MEANINGFUL_EPSILON = 10.0
#: The noise is "orders of magnitude" under the update it hides when the clip is this many stds or more.
NOISE_UNDER = 100.0
#: The delta the mechanism text states epsilon at where the configuration names none.
REPORT_DELTA = 1e-5


def flower_missing() -> str | None:
    """Why Flower's mechanisms cannot run here (None: they can), found without importing Flower."""
    return None if find_spec("flwr") else "needs Flower: pip install 'leakaudit[flower]'"


def flower_dp() -> Any:
    """Flower's differential-privacy functions (``flwr.supercore.differential_privacy``; older releases:
    ``flwr.common.differential_privacy``)."""
    try:
        from flwr.supercore import differential_privacy
    except ImportError:
        from flwr.common import differential_privacy  # type: ignore[no-redef]
    return differential_privacy


@contextmanager
def numpy_draws_from(generator: torch.Generator) -> Iterator[None]:
    """NumPy's global generator (where Flower draws its noise) seeded from ``generator``, put back after."""
    import numpy as np

    seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=generator, device=generator.device).item())
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def to_arrays(update: Sequence[Tensor]) -> list[Any]:
    return [t.detach().cpu().numpy().copy() for t in update]


def from_arrays(arrays: Sequence[Any], like: Sequence[Tensor]) -> list[Tensor]:
    return [torch.as_tensor(a.copy()).to(t) for a, t in zip(arrays, like)]


def on_floating(update: Sequence[Tensor], change: Callable[[list[Any]], list[Any]]) -> list[Tensor]:
    """``change`` (Flower's functions on NumPy arrays) applied to the update's floating-point arrays only, as Flower
    1.45 applies its DP: an integer array (BatchNorm's ``num_batches_tracked``) is sent as it is, out of the norm."""
    import numpy as np

    arrays = to_arrays(update)
    kept = [i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.floating)]
    for i, changed in zip(kept, change([arrays[i] for i in kept])):
        arrays[i] = changed
    return from_arrays(arrays, update)


def flower_float_only() -> bool:
    """Whether the installed Flower applies DP to floating-point arrays only (1.45): its clip leaves an integer
    array such as ``num_batches_tracked`` (0-d) out of the norm. Older releases count it in the norm (and fail on a
    1-d one: a float scale cast into integers)."""
    import numpy as np

    arrays = [np.array([3.0, 4.0]), np.array(7, dtype=np.int64)]
    try:
        flower_dp().compute_clip_model_update(arrays, [np.zeros(2), np.array(0, dtype=np.int64)], 1.0)
    except TypeError:  # NumPy's UFuncTypeError
        return False
    return bool(int(arrays[1]) == 7 and abs(float(np.linalg.norm(arrays[0])) - 1.0) < 1e-9)


def integer_arrays_refusal(what: str, state: dict[str, Tensor]) -> str | None:
    """Why ``what`` (a Flower DP mod or strategy) cannot be audited on a model whose ``state`` holds integer arrays
    under the installed Flower: it counts them in the norm it clips to, which leakaudit's ``flower_*`` defenses (DP
    on floating-point arrays only) do not mirror; None where Flower leaves them out too, or there are none."""
    integers = [n for n, t in state.items() if not (t.is_floating_point() or t.is_complex())]
    if not integers or flower_float_only():
        return None
    from importlib.metadata import version

    return (f"{what}: Flower {version('flwr')} counts the model's integer arrays ({', '.join(integers[:3])}"
            f"{', ...' if len(integers) > 3 else ''}: the local steps taken) in the norm it clips the update to, so "
            "the update leaves clipped tighter than clipping_norm, which leakaudit does not mirror; audit it with a "
            "Flower that applies DP to floating-point arrays only (1.45): pip install -U flwr")


def flower_clip(update: Sequence[Any], clipping_norm: float) -> list[Any]:
    """The update clipped by Flower's ``compute_clip_model_update`` (the model's change, server weights at zero)."""
    import numpy as np

    sent = list(update)
    flower_dp().compute_clip_model_update(sent, [np.zeros_like(a) for a in sent], clipping_norm)
    return sent


def clipped(update: Sequence[Tensor], clipping_norm: float) -> list[Tensor]:
    """The likelihood's centre: the update's floating-point tensors scaled to L2 norm at most ``clipping_norm``, as
    Flower's FlatClip (McMahan et al. 2018), differentiably; any other tensor as it is (``on_floating``)."""
    norm = torch.sqrt(sum((g ** 2).sum() for g in update if g.is_floating_point()))  # type: ignore[arg-type]
    factor = torch.clamp(clipping_norm / norm.clamp_min(1e-30), max=1.0)
    return [g * factor if g.is_floating_point() else g for g in update]


def dp_strategy(mechanism: Any, kind: str) -> str | None:
    """"client" or "server": who clips under the Flower central-DP strategy ``mechanism`` of ``kind`` ("Fixed" or
    "Adaptive"), from the Message API's ``flwr.serverapp.strategy`` or the older ``flwr.server.strategy``; None for
    anything else. Flower is not imported here: an object of its classes means it is loaded already."""
    for side in ("Client", "Server"):
        name = f"DifferentialPrivacy{side}Side{kind}Clipping"
        kinds = tuple(getattr(sys.modules[m], name) for m in ("flwr.serverapp.strategy", "flwr.server.strategy")
                      if m in sys.modules and hasattr(sys.modules[m], name))
        if kinds and isinstance(mechanism, kinds):
            return side.lower()
    return None


def flower_accountant(mechanism: Any) -> Any | None:
    """The privacy accountant a Flower central-DP strategy carries (``accountant=``, Flower's ``RdpAccountant`` or
    any ``flwr.serverapp.PrivacyAccountant``); None where it carries none, or ``mechanism`` is no DP strategy."""
    if dp_strategy(mechanism, "Fixed") is None and dp_strategy(mechanism, "Adaptive") is None:
        return None
    return getattr(mechanism, "accountant", None)


def accountant_reading(accountant: Any, defense: Defense, num_sampled_clients: int, population: Sequence[int],
                       sampled: Sequence[int]) -> list[str]:
    """Flower's accountant's claimed epsilon beside leakaudit's own accounting of ``defense`` (its per-round
    guarantee composed exactly over the same releases, no credit for sampling), then one line per mismatch between
    what the accountant was given and what the strategy did: ``population``, the nodes it sampled from each round;
    ``sampled``, the clients it sampled each round."""
    config, spent = accountant.config, accountant.get_privacy_spent()
    method = getattr(config.sampling_method, "value", str(config.sampling_method))
    own = defense.privacy_spent(spent.num_releases, 1.0, spent.delta)
    claim = (f"Flower's accountant ({spent.accounting_method}, {method}, population_size {config.population_size}) "
             f"claims epsilon {spent.epsilon:.4g} at delta {spent.delta:g} over {spent.num_releases} releases; "
             f"leakaudit's own accounting of the same releases: epsilon {own:.4g} ({defense.name}, its per-round "
             "guarantee composed exactly, no credit for sampling)" if own is not None else "")
    out = [claim]
    for n in sorted(set(population) - {config.population_size}):
        out.append(f"MISMATCH: the accountant's population_size {config.population_size} is not the {n} nodes the "
                   "strategy samples from: an epsilon amplified by sampling would be wrong")
    for k in sorted(set(sampled) - {num_sampled_clients}):
        out.append(f"MISMATCH: the strategy sampled {k} clients in a round, while its noise and the accountant's "
                   f"events assume num_sampled_clients {num_sampled_clients}")
    if method == "poisson":
        out.append("MISMATCH: the accountant credits Poisson sampling; Flower's strategies sample a fixed number of "
                   "nodes without replacement")
    if own is not None and spent.num_releases and spent.epsilon < own * (1 - 1e-3):
        out.append(f"MISMATCH: the accountant's epsilon {spent.epsilon:.4g} is below the {own:.4g} a client's own "
                   "update spends over those releases (the server, or anyone who knows it was sampled, gets no "
                   "sampling credit)")
    return [line for line in out if line]


def framework_refusal(name: str, missing: str | None, verb: str, protocol: Protocol) -> str | None:
    """Why a framework's mechanism ``name`` cannot run: its package ``missing``, or ``protocol`` the mean of several
    clients, while the mechanism ``verb``s one client's update (Flower's clip, FLARE's filters); None where it can."""
    if missing:
        return f"{name} {missing}"
    if isinstance(protocol, FedAvg) and protocol.clients > 1:
        return (f"{name} {verb}s one client's update; with clients: {protocol.clients} the protocol would {verb} "
                "their mean: use clients: 1")
    return None


def guarantee_notes(mu: float, std: float, clip: float, rounds: int) -> list[str]:
    """What a configuration's guarantee really says: epsilon per round and over ``rounds``, the noise against the
    update, and a warning where either is past a meaningful range."""
    one = PrivacyProfile(mu=mu)
    per_round, total = one.epsilon(REPORT_DELTA), one.epsilon(REPORT_DELTA, rounds)
    out = [f"epsilon {per_round:.3g} per round, {total:.3g} over {rounds} rounds (delta {REPORT_DELTA:g})"]
    if std == 0:
        out.append("WARNING: no noise: no guarantee")
    elif clip / std >= NOISE_UNDER:
        out.append(f"WARNING: noise std {std:.3g} is {clip / std:.3g} times under the clipped update's norm "
                   f"{clip:g}: it hides nothing")
    if std > 0 and per_round > MEANINGFUL_EPSILON:
        out.append(f"WARNING: epsilon {per_round:.3g} per round is past any meaningful range (above "
                   f"{MEANINGFUL_EPSILON:g})")
    return out


class FlowerDefense(Defense):
    """What Flower's three mechanisms share: the extra, the rounds their epsilon is stated over, the likelihood."""

    paper = "Beutel et al. 2020"
    clipping_norm: float
    rounds: int

    def unsupported(self, protocol: Protocol) -> str | None:
        return framework_refusal(self.name, flower_missing(), "clip", protocol)

    def noise_std(self) -> float:
        """The standard deviation of the noise on the update, as Flower computes it."""
        raise NotImplementedError

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """Gaussian with Flower's std around the candidate clipped to ``clipping_norm`` (zero-noise limit at 0)."""
        distance = squared_distance(observed.tensors, clipped(candidate, self.clipping_norm))
        std = self.noise_std()
        return -0.5 * distance if std == 0 else -distance / (2 * std ** 2)

    def mu(self, radius: float | None = None) -> float:
        """One release's GDP parameter: the clip's bound (or a tighter one before it) over the noise's std."""
        clip = self.clipping_norm if radius is None else min(radius, self.clipping_norm)
        std = self.noise_std()
        return math.inf if std == 0 else clip / std

    def privacy_spent(self, steps: int, sample_rate: float, delta: float) -> float | None:
        """Epsilon at ``delta`` after ``steps`` rounds: each a fresh Gaussian release of the clipped update,
        composed exactly as GDP (no credit for the sampling of clients, which the attacked client's rounds lack)."""
        return PrivacyProfile(mu=self.mu()).epsilon(delta, steps) if steps >= 1 else 0.0


class FlowerLocalDp(FlowerDefense):
    """Flower's LocalDpMod: the client's change over the round clipped to ``clipping_norm`` (FlatClip), then
    Gaussian noise of std ``sensitivity * sqrt(2 ln(1.25 / delta)) / epsilon`` (Dwork & Roth 2014, Thm. A.1) on
    every parameter, by Flower's own functions. The guarantee is the clip's: ``clipping_norm / std``-GDP per round;
    the configured epsilon holds only where ``sensitivity`` is at least ``clipping_norm`` (and epsilon < 1).
    Audit it under ``protocol: fedavg`` (the change Flower clips); under fedsgd the gradient is clipped as a change
    at learning rate 1. Needs ``leakaudit[flower]``."""

    name = "flower_local_dp"
    params = {
        "clipping_norm": Param(type=float, min=0.0, exclusive_min=True, help="LocalDpMod's clipping_norm",
                               example=1.0),
        "sensitivity": Param(type=float, min=0.0, help="LocalDpMod's sensitivity (the noise's scale)", example=1.0),
        "epsilon": Param(type=float, min=0.0, exclusive_min=True, protects="lower", help="LocalDpMod's epsilon",
                         example=1.0),
        "delta": Param(type=float, min=0.0, max=1.0, exclusive_min=True, help="LocalDpMod's delta (below 1)",
                       example=1e-5),
        "rounds": Param(1, int, min=1, help="server rounds the epsilon is stated over in the report"),
    }
    sensitivity: float
    epsilon: float
    delta: float

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        if self.delta >= 1:
            raise ValueError(f"flower_local_dp: delta {self.delta!r}; expected below 1 (ln(1.25 / delta) > 0)")

    def noise_std(self) -> float:
        return self.sensitivity * math.sqrt(2 * math.log(1.25 / self.delta)) / self.epsilon

    @classmethod
    def mirrored_settings(cls, mechanism: Any) -> dict[str, Any] | None:
        """A Flower ``LocalDpMod`` (the Message API's ``flwr.clientapp.mod`` or the older ``flwr.client.mod``):
        its clipping_norm, sensitivity, epsilon and delta. Flower is not imported here: an object of its classes
        means it is loaded already."""
        kinds = tuple(getattr(sys.modules[m], "LocalDpMod") for m in ("flwr.clientapp.mod", "flwr.client.mod")
                      if m in sys.modules and hasattr(sys.modules[m], "LocalDpMod"))
        if not kinds or not isinstance(mechanism, kinds):
            return None
        return {k: float(getattr(mechanism, k)) for k in ("clipping_norm", "sensitivity", "epsilon", "delta")}

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        """Flower's ``compute_clip_model_update``, then its ``add_localdp_gaussian_noise_to_params``."""
        from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays

        def local_dp(arrays: list[Any]) -> list[Any]:
            sent = flower_clip(arrays, self.clipping_norm)
            with numpy_draws_from(generator):
                return parameters_to_ndarrays(flower_dp().add_localdp_gaussian_noise_to_params(
                    ndarrays_to_parameters(sent), self.sensitivity, self.epsilon, self.delta))

        return on_floating(update, local_dp)

    def privacy_profile(self, radius: float | None = None) -> PrivacyProfile:
        std, mu = self.noise_std(), self.mu(radius)
        notes = guarantee_notes(mu, std, self.clipping_norm if radius is None else min(radius, self.clipping_norm),
                         self.rounds)
        if self.sensitivity < self.clipping_norm:
            notes.append(f"sensitivity {self.sensitivity:g} is under clipping_norm {self.clipping_norm:g}: the "
                         f"configured epsilon {self.epsilon:g} is not what a round spends")
        return PrivacyProfile(mu=mu, mechanism=f"Flower LocalDpMod: clip {self.clipping_norm:g}, noise std {std:.3g} "
                                               f"(sensitivity {self.sensitivity:g}, epsilon {self.epsilon:g}, delta "
                                               f"{self.delta:g}); " + "; ".join(notes))


class FlowerFixedClipping(FlowerDefense):
    """Flower's DifferentialPrivacy{ClientSide,ServerSide}FixedClipping (central DP, McMahan et al. 2018): each
    client's change clipped to ``clipping_norm`` (``fixedclipping_mod`` on the client, or the server), the mean of
    ``num_sampled_clients`` clipped changes plus Gaussian noise of std ``noise_multiplier * clipping_norm /
    num_sampled_clients`` (Flower's ``compute_stdv``). Shared: what an observer of the noisy mean who knows the
    other clients learns of this one, the mean's share of it scaled back by the number of clients (the clipped
    change plus noise of std ``noise_multiplier * clipping_norm``); ``1 / noise_multiplier``-GDP per round. The
    guarantee covers the released mean, not the server: server side, the server itself receives the change
    unclipped (audit it as ``none``); client side, clipped (``clip``). Needs ``leakaudit[flower]``."""

    name = "flower_fixed_clipping"
    params = {
        "clipping_norm": Param(type=float, min=0.0, exclusive_min=True, help="the strategy's clipping_norm",
                               example=1.0),
        "noise_multiplier": Param(type=float, min=0.0, protects="higher", help="the strategy's noise_multiplier",
                                  example=1.0),
        "num_sampled_clients": Param(type=int, min=1, help="the strategy's num_sampled_clients", example=10),
        "side": Param("client", str, choices=("client", "server"), help="who clips: the client's "
                      "fixedclipping_mod or the server (it then sees the change unclipped)"),
        "rounds": Param(1, int, min=1, help="server rounds the epsilon is stated over in the report"),
    }
    noise_multiplier: float
    num_sampled_clients: int
    side: str

    def noise_std(self) -> float:
        return self.noise_multiplier * self.clipping_norm

    @classmethod
    def mirrored_settings(cls, mechanism: Any) -> dict[str, Any] | None:
        """A Flower ``DifferentialPrivacy{ClientSide,ServerSide}FixedClipping`` strategy: its clipping norm, noise
        multiplier, number of sampled clients, and who clips."""
        side = dp_strategy(mechanism, "Fixed")
        if side is None:
            return None
        return {"clipping_norm": float(mechanism.clipping_norm), "noise_multiplier": float(mechanism.noise_multiplier),
                "num_sampled_clients": int(mechanism.num_sampled_clients), "side": side}

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        """Flower's ``compute_clip_model_update``; the mean's share (1 / num_sampled_clients) noised by its
        ``add_gaussian_noise_inplace`` at ``compute_stdv``, scaled back."""
        dp, n = flower_dp(), self.num_sampled_clients

        def central_dp(arrays: list[Any]) -> list[Any]:
            share = [a / n for a in flower_clip(arrays, self.clipping_norm)]
            with numpy_draws_from(generator):
                dp.add_gaussian_noise_inplace(share, dp.compute_stdv(self.noise_multiplier, self.clipping_norm, n))
            return [a * n for a in share]

        return on_floating(update, central_dp)

    def privacy_profile(self, radius: float | None = None) -> PrivacyProfile:
        notes = guarantee_notes(self.mu(radius), self.noise_std(), self.clipping_norm, self.rounds)
        seen = "unclipped" if self.side == "server" else f"clipped to {self.clipping_norm:g}, without noise"
        return PrivacyProfile(mu=self.mu(radius), mechanism=(
            f"Flower {self.side}-side fixed clipping: clip {self.clipping_norm:g}, noise multiplier "
            f"{self.noise_multiplier:g} on the mean of {self.num_sampled_clients} (std "
            f"{self.noise_std() / self.num_sampled_clients:.3g}); " + "; ".join(notes)
            + f"; the server itself sees the update {seen}"))


class FlowerAdaptiveClipping(FlowerDefense):
    """Flower's DifferentialPrivacy{ClientSide,ServerSide}AdaptiveClipping (Andrew et al. 2021) at one round: the
    change clipped to that round's ``clipping_norm`` (``compute_adaptive_clip_model_update``), the mean of
    ``num_sampled_clients`` noised at the multiplier that Flower's ``compute_adaptive_noise_params`` leaves once the
    count of clipped clients (noise std ``clipped_count_stddev``, default num_sampled_clients / 20) has taken its
    share; shared as ``flower_fixed_clipping`` shares (the mean's share scaled back). The guarantee of update and
    count together is ``1 / noise_multiplier``-GDP per round; the likelihood covers the update (the clipped bit goes
    into the server's noisy count, not to the attacker of this update). Needs ``leakaudit[flower]``."""

    name = "flower_adaptive_clipping"
    params = {
        "clipping_norm": Param(0.1, float, min=0.0, exclusive_min=True,
                               help="the round's clipping norm (Flower's initial_clipping_norm at round 1)"),
        "noise_multiplier": Param(type=float, min=0.0, protects="higher", help="the strategy's noise_multiplier",
                                  example=0.5),
        "num_sampled_clients": Param(type=int, min=1, help="the strategy's num_sampled_clients", example=100),
        "clipped_count_stddev": Param(None, float, min=0.0, exclusive_min=True,
                                      help="noise on the count of clipped clients (default num_sampled_clients / 20)"),
        "side": Param("client", str, choices=("client", "server"), help="who clips: the client's "
                      "adaptiveclipping_mod or the server (it then sees the change unclipped)"),
        "rounds": Param(1, int, min=1, help="server rounds the epsilon is stated over in the report"),
    }
    noise_multiplier: float
    num_sampled_clients: int
    clipped_count_stddev: float | None
    side: str

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        count = self.count_stddev()
        if self.noise_multiplier > 0 and self.noise_multiplier >= 2 * count:
            raise ValueError(f"flower_adaptive_clipping: noise_multiplier {self.noise_multiplier:g} needs "
                             f"clipped_count_stddev above {self.noise_multiplier / 2:g} (it is {count:g}); raise "
                             "clipped_count_stddev or lower noise_multiplier")

    def count_stddev(self) -> float:
        given = self.clipped_count_stddev
        return (self.num_sampled_clients / 20 if self.noise_multiplier > 0 else 0.0) if given is None else given

    def update_multiplier(self) -> float:
        """The update's own noise multiplier: (z^-2 - (2 sigma_b)^-2)^(-1/2), as Flower's
        ``compute_adaptive_noise_params`` computes it."""
        if self.noise_multiplier == 0:
            return 0.0
        return (self.noise_multiplier ** -2 - (2 * self.count_stddev()) ** -2) ** -0.5

    def noise_std(self) -> float:
        return self.update_multiplier() * self.clipping_norm

    @classmethod
    def mirrored_settings(cls, mechanism: Any) -> dict[str, Any] | None:
        """A Flower ``DifferentialPrivacy{ClientSide,ServerSide}AdaptiveClipping`` strategy at its current round: its
        clipping norm, noise multiplier, number of sampled clients, the count's noise, and who clips."""
        side = dp_strategy(mechanism, "Adaptive")
        if side is None:
            return None
        return {"clipping_norm": float(mechanism.clipping_norm), "noise_multiplier": float(mechanism.noise_multiplier),
                "num_sampled_clients": int(mechanism.num_sampled_clients),
                "clipped_count_stddev": float(mechanism.clipped_count_stddev), "side": side}

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        """Flower's ``compute_adaptive_clip_model_update``; the mean's share noised by ``add_gaussian_noise_inplace``
        at ``compute_stdv`` of the multiplier ``compute_adaptive_noise_params`` returns, scaled back."""
        import numpy as np

        dp, n = flower_dp(), self.num_sampled_clients
        _, multiplier = dp.compute_adaptive_noise_params(self.noise_multiplier, n, self.clipped_count_stddev)

        def adaptive_dp(sent: list[Any]) -> list[Any]:
            dp.compute_adaptive_clip_model_update(sent, [np.zeros_like(a) for a in sent], self.clipping_norm)
            share = [a / n for a in sent]
            with numpy_draws_from(generator):
                dp.add_gaussian_noise_inplace(share, dp.compute_stdv(multiplier, self.clipping_norm, n))
            return [a * n for a in share]

        return on_floating(update, adaptive_dp)

    def privacy_profile(self, radius: float | None = None) -> PrivacyProfile:
        mu = math.inf if self.noise_multiplier == 0 else 1 / self.noise_multiplier
        notes = guarantee_notes(mu, self.noise_std(), self.clipping_norm, self.rounds)
        seen = "unclipped" if self.side == "server" else f"clipped to {self.clipping_norm:g}, without noise"
        return PrivacyProfile(mu=mu, mechanism=(
            f"Flower {self.side}-side adaptive clipping at clip {self.clipping_norm:g}: noise multiplier "
            f"{self.noise_multiplier:g} ({self.update_multiplier():.3g} on the update, count std "
            f"{self.count_stddev():g}) on the mean of {self.num_sampled_clients}; " + "; ".join(notes)
            + f"; the server itself sees the update {seen}"))

    def privacy_spent(self, steps: int, sample_rate: float, delta: float) -> float | None:
        """Epsilon at ``delta`` after ``steps`` rounds of update and count: ``sqrt(steps) / noise_multiplier``-GDP."""
        return self.privacy_profile().epsilon(delta, steps) if steps >= 1 else 0.0


@hookimpl
def register_defenses():
    return [FlowerLocalDp, FlowerFixedClipping, FlowerAdaptiveClipping]
