"""``check_defense`` for plugin authors: a defense's declared likelihood against what it sends.

It draws many shares of one batch and asks whether ``log_likelihood`` explains them: the
true candidate must have the highest expected log-likelihood (the score has mean zero there), and the
likelihood's curvature must equal the variance of its score across shares, the information-matrix
equality that holds when a density is correctly specified (White 1982). A declared Gaussian of the
wrong scale, or the wrong noise family, breaks the second; a likelihood centred off what ``share()``
sends breaks the first. A defense that declares a privacy guarantee (``privacy_profile``) is also audited:
the shares of two batches one example apart must be no easier to tell apart than the guarantee allows
(Jagielski et al. 2020). It raises AssertionError with one line per problem, so it reads well under pytest.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leakaudit.attacks.vectorised import split_metadata, stack_targets
from leakaudit.evaluator.authoring.cases import case_or_tiny, check_threat, seeded_generator
from leakaudit.evaluator.results.verdict import exact_interval
from leakaudit.plugins.defense import Defense, PrivacyProfile, SharedUpdate
from leakaudit.plugins.protocol import FEDSGD, ClientStep, Protocol, parameter_names, trainable


#: Two-sided level of the intervals the checks judge by: a correct plugin fails about once in a thousand seeds.
CONFIDENCE = 0.999
Z = 3.29  # the standard normal quantile of CONFIDENCE, two-sided
#: How far the score variance may stray from the curvature before it is a problem (the equivalence margin).
SCALE_TOLERANCE = 1.05
#: A direction along which the expected log-likelihood curves less than this share of the most it curves along
#: any is flat: the likelihood does not tell candidates apart along it, and the tests leave it out.
FLAT = 1e-6
#: Shares drawn beside those tested, to aim one direction at their mean offset without selecting it from the data tested.
HELD_OUT = 32


@dataclass
class DefenseCheck:
    """What ``check_defense`` measured.

    ``kind`` is ``exact`` (every share is most likely under the true candidate: a deterministic defense,
    or one whose likelihood is a zero-noise limit), ``noisy`` (tested statistically) or ``no likelihood``.
    ``scale_ratio`` is the shares' score variance over the likelihood's curvature: 1 when the declared
    noise matches the noise sent, about (sent / declared)^2 for a Gaussian of the wrong scale.
    """

    defense: str
    kind: str
    shares: int
    directions: int
    flat_directions: int = 0
    centre_z: float | None = None
    scale_ratio: float | None = None
    scale_interval: tuple[float, float] | None = None
    #: Where the defense declares a privacy profile: the test that tells two batches apart (false positive rate,
    #: true positive rate, each at its interval's end) and the most power the profile allows at that rate.
    privacy_test: tuple[float, float, float] | None = None
    problems: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        text = f"{self.defense}: {self.kind}, {self.shares} shares x {self.directions} directions"
        text += f" ({self.flat_directions} flat)" if self.flat_directions else ""
        if self.scale_ratio is not None:
            lo, hi = self.scale_interval or (math.nan, math.nan)
            text += (f"; largest |z| of the score at the true candidate {self.centre_z:.2f}; score variance / "
                     f"curvature {self.scale_ratio:.3f} ({CONFIDENCE:.1%} interval {lo:.3f}-{hi:.3f})")
        if self.privacy_test is not None:
            fpr, tpr, allowed = self.privacy_test
            text += f"; two batches told apart at true positive rate {tpr:.3f} (at most {allowed:.3f} allowed)"
        return text


def _contract_problems(sent: SharedUpdate, model: nn.Module, inputs: Tensor) -> list[str]:
    """What is wrong with one share against the SharedUpdate contract (a tensor per trainable parameter)."""
    if not isinstance(sent, SharedUpdate):
        return [f"share() returned a {type(sent).__name__}, not a SharedUpdate"]
    params, names = trainable(model), parameter_names(model)
    if len(sent.tensors) != len(params):
        return [f"share() sent {len(sent.tensors)} tensors for the model's {len(params)} trainable parameters"]
    problems = [f"share() sent {n} with shape {tuple(t.shape)}, the parameter's is {tuple(p.shape)}"
                for n, t, p in zip(names, sent.tensors, params) if t.shape != p.shape]
    if list(sent.names) != names:
        problems.append("share() named its tensors differently from the model's trainable parameters")
    if sent.batch_size != len(inputs):
        problems.append(f"share() reported batch_size {sent.batch_size} for a batch of {len(inputs)}")
    if not all(torch.isfinite(t).all() for t in sent.tensors):
        problems.append("share() sent values that are not finite")
    return problems


def _same(a: SharedUpdate, b: SharedUpdate) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))


def _draw_shares(defense: Defense, model: nn.Module, inputs: Tensor, labels: Tensor, protocol: Protocol,
                 count: int, seed: int) -> tuple[list[SharedUpdate], list[str]]:
    """``count + HELD_OUT`` shares of the batch, each from its own seeded generator, and the contract's problems."""
    def share(i: int) -> SharedUpdate:
        return defense.share(ClientStep(model, F.cross_entropy, inputs, labels,
                                        seeded_generator(inputs.device, seed * 1_000_003 + i), protocol))

    first = share(0)
    problems = _contract_problems(first, model, inputs)
    if problems:
        return [first], problems
    if not _same(first, share(0)):
        problems.append("share() is not reproducible: two generators seeded alike gave different updates; draw "
                        "every random number from step.generator")
    shares = [first] + [share(i) for i in range(1, count + HELD_OUT)]
    if defense.deterministic and not all(_same(first, s) for s in shares[1:]):
        problems.append("declares deterministic = True, but share() sent different updates under different "
                        "generators (a chain relies on deterministic members)")
    return shares, problems


def _in_float64(update: SharedUpdate) -> SharedUpdate:
    """The share in double precision, so that the small differences of log-likelihoods the check takes stay exact."""
    return replace(update, tensors=[t.double() for t in update.tensors])


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(vector: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    out, start = [], 0
    for t in like:
        out.append(vector[start:start + t.numel()].view_as(t))
        start += t.numel()
    return out


def _directions(truth: Tensor, mean_share: Tensor, count: int, generator: torch.Generator) -> list[tuple[str, Tensor]]:
    """Unit directions to move the candidate along: the update itself (a scale bug), held-out shares' mean
    offset from it (a bias the likelihood leaves out), and random ones."""
    named = [("the update's own direction", truth), ("the shares' mean offset", mean_share - truth)]
    named = [(what, d / d.norm()) for what, d in named if d.norm() > 1e-12 * (1 + truth.norm())]
    while len(named) < count:
        d = torch.randn(truth.shape, generator=generator, device=truth.device, dtype=truth.dtype)
        named.append((f"random direction {len(named) + 1}", d / d.norm()))
    return named[:count]


def _likelihood_problems(defense: Defense, shares: list[SharedUpdate], truth: list[Tensor]) -> list[str]:
    """Whether ``log_likelihood`` gives a finite scalar that the attacker can differentiate in the candidate."""
    candidate = [t.clone().requires_grad_(True) for t in truth]
    value = defense.log_likelihood(shares[0], candidate)
    if not isinstance(value, Tensor) or value.numel() != 1:
        return [f"log_likelihood returned {type(value).__name__}, not a scalar tensor"]
    if not torch.isfinite(value):
        return ["log_likelihood is not finite at the true candidate"]
    if not value.requires_grad:
        return ["log_likelihood is not differentiable in the candidate (the Bayes attacker follows its gradient)"]
    grads = torch.autograd.grad(value, candidate, allow_unused=True)
    if all(g is None for g in grads) or not all(torch.isfinite(g).all() for g in grads if g is not None):
        return ["log_likelihood has no finite gradient in the candidate (the Bayes attacker follows it)"]
    return []


def _vmap_problems(defense: Defense, shares: list[SharedUpdate], truth: list[Tensor]) -> list[str]:
    """Whether ``log_likelihood`` runs under ``torch.func.vmap`` with one observed update per problem, as the
    vectorised Bayes attacker evaluates it for many targets at once, and gives there what it gives alone."""
    pair = shares[:2]
    split = split_metadata(pair)
    if len(pair) < 2 or split is None:  # metadata that differs between problems: the engine solves them alone
        return []
    stacked, static = split
    targets = stack_targets(pair, truth[0].device)
    candidates = [torch.stack([t, 0.9 * t]) for t in truth]

    def one(target: list[Tensor], metadata: dict, candidate: list[Tensor]) -> Tensor:
        observed = SharedUpdate(list(target), pair[0].names, pair[0].batch_size, {**static, **metadata})
        return defense.log_likelihood(observed, list(candidate)).reshape(())

    try:
        with torch.no_grad():
            together = torch.func.vmap(one)(targets, stacked, candidates)
    except RuntimeError as exc:
        return [f"log_likelihood fails under torch.func.vmap, where the vectorised bayes attack evaluates it for "
                f"many targets at once ({str(exc).splitlines()[0][:120]}); write data-dependent branches "
                "(if on a tensor, .item(), boolean indexing) with torch.where"]
    with torch.no_grad():
        alone = torch.stack([defense.log_likelihood(s, [c[i] for c in candidates]).reshape(())
                             for i, s in enumerate(pair)])
    if not torch.allclose(together, alone, rtol=1e-9, atol=1e-9):
        return [f"log_likelihood under torch.func.vmap gives {together.tolist()}, alone {alone.tolist()}: a "
                "likelihood must treat each problem of a batch as it treats one alone"]
    return []


def _log_likelihoods(defense: Defense, shares: list[SharedUpdate], like: list[Tensor], points: Tensor) -> Tensor:
    """``log p(share_i | candidate_m)`` for every share ``i`` and flat candidate ``points[m]``: (shares, points)."""
    with torch.no_grad():
        return torch.stack([torch.stack([defense.log_likelihood(s, _unflat(p, like)).double().reshape(())
                                         for p in points]) for s in shares])


@dataclass
class Moves:
    """Log-likelihoods of every share at the true candidate (``base``: (shares, 1)) and at the candidate moved
    ``steps[j]`` forward (``up``) and back (``down``) along direction ``j``, as differences from ``base``."""

    steps: Tensor
    base: Tensor
    up: Tensor
    down: Tensor

    @classmethod
    def measure(cls, defense: Defense, shares: list[SharedUpdate], truth: Tensor, like: list[Tensor],
                directions: Tensor, steps: Tensor) -> "Moves":
        moves = steps[:, None] * directions
        values = _log_likelihoods(defense, shares, like, torch.cat([truth[None], truth + moves, truth - moves]))
        base, k = values[:, :1], len(steps)
        return cls(steps, base, values[:, 1:k + 1] - base, values[:, k + 1:] - base)

    @property
    def scores(self) -> Tensor:
        """Each share's derivative of the log-likelihood along each direction, by central differences."""
        return (self.up - self.down) / (2 * self.steps)

    @property
    def curvature(self) -> Tensor:
        """Each share's minus second derivative along each direction, by central differences."""
        return -(self.up + self.down) / self.steps ** 2


@dataclass
class Slopes:
    """Each share's slope of the log-likelihood at the true candidate along each direction (``scores``, (shares,
    directions)) and its minus second derivative (``curvature``), by autograd: for a likelihood of bounded support,
    where a finite step can leave the support."""

    scores: Tensor
    curvature: Tensor

    @classmethod
    def measure(cls, defense: Defense, shares: list[SharedUpdate], truth: Tensor, like: list[Tensor],
                directions: Tensor) -> "Slopes":
        scores, curvature = [], []
        for share in shares:
            slope = torch.func.grad(lambda x: defense.log_likelihood(share, _unflat(x, like)).double().reshape(()))
            gradient, bends = torch.func.vmap(lambda d: torch.func.jvp(slope, (truth,), (d,)))(directions)[:2]
            scores.append((gradient * directions).sum(-1))
            curvature.append(-(bends * directions).sum(-1))
        return cls(torch.stack(scores), torch.stack(curvature))

    def __getitem__(self, kept: Tensor) -> "Slopes":
        return Slopes(self.scores[:, kept], self.curvature[:, kept])


def _scale_ratio(scores: Tensor, curvature: Tensor, generator: torch.Generator,
                 resamples: int = 1000) -> tuple[float, float, float]:
    """Score variance over curvature, summed over directions, with a percentile interval over resampled shares."""
    def ratio(rows: Tensor) -> Tensor:
        return scores[rows].var(dim=-2).sum(-1) / curvature[rows].mean(dim=-2).sum(-1)

    n = len(scores)
    rows = torch.randint(n, (resamples, n), generator=generator, device=scores.device)
    boot = ratio(rows).sort().values
    tail = (1 - CONFIDENCE) / 2
    lo, hi = boot[int(tail * (resamples - 1))], boot[math.ceil((1 - tail) * (resamples - 1))]
    return float(ratio(torch.arange(n, device=scores.device))), float(lo), float(hi)


def _statistical_problems(at: Moves | Slopes, names: list[str], check: DefenseCheck,
                          generator: torch.Generator) -> list[str]:
    """The centre and scale tests of a noisy defense, from each share's slopes and curvature at the true candidate."""
    scores, curvature, n = at.scores, at.curvature, len(at.scores)
    problems = []
    z = scores.mean(0) / (scores.std(0) / math.sqrt(n)).clamp_min(1e-300)
    check.centre_z = float(z.abs().max())
    z_crit = Z + math.sqrt(2 * math.log(len(names)))  # about Bonferroni over the directions
    off = int((z.abs() > z_crit).sum())
    if off:
        j = int(z.abs().argmax())
        slope = scores[:, j] * z[j].sign()
        others = f"; so do {off - 1} more of the {len(names)} directions" if off > 1 else ""
        way = "along" if z[j] > 0 else "against"
        problems.append(f"a candidate moved {way} {names[j]} has a higher expected log-likelihood than the true one "
                        f"(slope {float(slope.mean()):.3g} +- {float(slope.std() / math.sqrt(n)):.2g} over {n} "
                        f"shares; z = {float(z[j]):.1f}{others}): log_likelihood is not centred on what share() sends")
    ratio, lo, hi = _scale_ratio(scores, curvature, generator)
    check.scale_ratio, check.scale_interval = ratio, (lo, hi)
    if lo > SCALE_TOLERANCE or hi < 1 / SCALE_TOLERANCE:
        sharper = ratio > 1
        problems.append(f"log_likelihood is {'sharper' if sharper else 'flatter'} than what share() sends: the "
                        f"shares' score variance is {ratio:.3g}x the likelihood's curvature ({CONFIDENCE:.1%} "
                        f"interval {lo:.3g}-{hi:.3g}; 1 when they agree), as if the noise sent were "
                        f"{math.sqrt(ratio):.3g}x the declared scale ({'an overconfident' if sharper else 'a timid'}"
                        " Bayes attacker)")
    return problems


def _neighbour(inputs: Tensor, labels: Tensor, classes: int) -> tuple[Tensor, Tensor]:
    """The batch with its first image replaced (by its negative, with the next label): one example apart."""
    other, other_labels = inputs.clone(), labels.clone()
    other[0] = inputs[0].max() + inputs[0].min() - inputs[0]
    other_labels[0] = (labels[0] + 1) % classes
    return other, other_labels


def _allowed_power(profile: PrivacyProfile, fpr: float) -> float:
    """The most power a test at false positive rate ``fpr`` can have between two batches one example apart under
    ``profile`` (each batch's update is within its guarantee of one reference: group privacy of two, Dong et al.
    2022): ``Phi(Phi^-1(fpr) + 2 mu)``, ``e^(2 epsilon) fpr + (1 + e^epsilon) delta``."""
    pairs = tuple((2 * e, min(1.0, (1 + math.exp(min(e, 700))) * d)) for e, d in profile.pairs)
    doubled = PrivacyProfile(mu=None if profile.mu is None else 2 * profile.mu, pairs=pairs)
    return doubled.reconstruction_bound(fpr)


def _privacy_problems(defense: Defense, model: nn.Module, inputs: Tensor, labels: Tensor, protocol: Protocol,
                      drawn: list[SharedUpdate], seed: int, check: DefenseCheck) -> list[str]:
    """Whether the shares of two batches one example apart are harder to tell apart than the defense's declared
    privacy profile says (a DP audit in the manner of Jagielski et al. 2020): a threshold test on the
    projection onto the first half's mean difference, its error rates on the second half with exact intervals."""
    profile = defense.privacy_profile()
    if profile is None:
        return []
    tail, n = 1 - CONFIDENCE, len(drawn) - len(drawn) // 2
    if _allowed_power(profile, float(exact_interval(0, n, tail)[1])) >= 1:
        return []  # even at the least false positive rate n shares can show, the profile allows any power
    classes = int(model(inputs[:1]).shape[1])
    other = _neighbour(inputs, labels, classes)
    theirs, _ = _draw_shares(defense, model, *other, protocol, len(drawn) - HELD_OUT, seed + 7919)
    a = torch.stack([s.flat() for s in drawn]).double()
    b = torch.stack([s.flat() for s in theirs[:len(drawn)]]).double()
    half = len(a) // 2
    direction = b[:half].mean(0) - a[:half].mean(0)
    if direction.norm() == 0:
        return []
    ta, tb = a[half:] @ direction, b[half:] @ direction
    threshold = float((a[:half] @ direction).mean() + (b[:half] @ direction).mean()) / 2
    n = len(ta)  # tail: one-sided, the false positive rate at its upper end, the true positive rate at its lower
    fpr = float(exact_interval(int((ta > threshold).sum()), n, tail)[1])
    tpr = float(exact_interval(int((tb > threshold).sum()), len(tb), tail)[0])
    allowed = _allowed_power(profile, fpr)
    check.privacy_test = (fpr, tpr, allowed)
    if tpr <= allowed:
        return []
    return [f"declares more privacy than it delivers: {profile.mechanism or repr(profile)} allows a test between two "
            f"batches one example apart a true positive rate of at most {allowed:.3f} at false positive rate "
            f"{fpr:.3f}, but a threshold on the shares' projection reaches {tpr:.3f} ({CONFIDENCE:.1%} ends of exact "
            "intervals); privacy_profile overstates the guarantee"]


def _exact_problems(at: Moves) -> tuple[bool, list[str]]:
    """Whether every share is most likely under the true candidate; if so, whether moving it ever matters."""
    moved = torch.cat([at.up, at.down], dim=1)
    slack = 1e-9 * (1 + at.base.abs())
    if (moved > slack).any():
        return False, []
    if not (moved < -slack).any():
        return True, ["log_likelihood does not change when the candidate moves: it ignores the candidate"]
    return True, []


def check_defense(defense: Defense, model: nn.Module | None = None, batch: tuple[Tensor, Tensor] | None = None, *,
                  protocol: Protocol = FEDSGD, shares: int = 256, directions: int = 32, seed: int = 0) -> DefenseCheck:
    """Check that ``defense.log_likelihood`` describes what ``defense.share`` sends; AssertionError if not.

    ``model`` and ``batch`` (inputs, labels) default to ``tiny_case()``; the model is wrapped by the
    defense (a copy) as in an audit. The shares are ``shares`` draws of one batch's update; the candidate
    is moved along ``directions`` directions. A defense without a likelihood is checked for its share
    contract only (the Bayes attacker does not apply to it). Returns what was measured.
    """
    __tracebackhide__ = True  # pytest shows the failing line of the author's test, not the check's insides
    if isinstance(defense, type):
        raise TypeError(f"check_defense takes a configured defense, e.g. {defense.__name__}(...), not the class")
    if shares < 16 or directions < 2:
        raise ValueError(f"check_defense: shares {shares} (at least 16) and directions {directions} (at least 2)")
    why = defense.unsupported(protocol)
    if why:
        raise AssertionError(f"{defense!r} refuses protocol {protocol.name}: {why}; pass protocol=")
    defense = defense.under(protocol)
    model, (inputs, labels) = case_or_tiny(model, batch, images=2, seed=seed)
    model = defense.wrap_model(copy.deepcopy(model)).to(inputs.device)
    drawn, problems = _draw_shares(defense, model, inputs, labels, protocol, shares, seed)
    drawn, held_out = drawn[:shares], drawn[shares:]
    check = DefenseCheck(repr(defense), "no likelihood", len(drawn), 0, problems=problems)
    if not problems:
        check.problems += _privacy_problems(defense, model, inputs, labels, protocol, drawn, seed, check)
    if check.problems or not defense.has_likelihood():
        return _conclude(check)
    threat = check_threat(model, inputs, labels, defense, protocol, known_labels=True)
    like = [t.detach().double() for t in defense.candidate_update(threat, inputs, labels)]
    drawn = [_in_float64(s) for s in drawn]
    check.problems += _likelihood_problems(defense, drawn, like) or _vmap_problems(defense, drawn, like)
    if check.problems:
        return _conclude(check)
    truth = _flat(like)
    gen = seeded_generator(truth.device, seed)
    offset = torch.stack([s.flat() for s in held_out]).double().mean(0) if held_out else truth
    named = _directions(truth, offset, directions, gen)
    names, unit = [what for what, _ in named], torch.stack([d for _, d in named])
    check.directions = len(names)
    first: Slopes | Moves
    if defense.bounded_support:
        try:
            first = Slopes.measure(defense, drawn, truth, like, unit)
        except (RuntimeError, NotImplementedError) as exc:
            check.problems.append("declares bounded_support, but torch.func cannot take log_likelihood's second "
                                  f"derivatives (grad, then jvp: {str(exc).splitlines()[0][:120]}); write it with "
                                  "differentiable torch operations")
            return _conclude(check)
        check.kind = "noisy"
    else:
        spread = (torch.stack([s.flat() for s in drawn]) @ unit.T).std(0)
        moves = Moves.measure(defense, drawn, truth, like, unit,
                              torch.where(spread > 1e-9 * (1 + truth.norm()), spread / 2, 1e-3 * (1 + truth.norm())))
        first = moves
        exact, found = _exact_problems(moves)
        check.kind = "exact" if exact else "noisy"
        if exact:
            check.problems += found
            return _conclude(check)
    # the first measurement gave the likelihood's curvature along each direction; the tests keep the directions where
    # it is not flat (clip's likelihood ignores the update's norm), by finite moves of a quarter of the width it
    # implies, or by the slopes already taken for a likelihood of bounded support
    curvature = first.curvature.mean(0)
    flat = curvature.abs() <= FLAT * curvature.abs().max()
    check.flat_directions = int(flat.sum())
    upward = torch.nonzero(~flat & (curvature < 0)).flatten().tolist()
    if upward or bool(flat.all()):
        where = f"along {names[upward[0]]} and {len(upward) - 1} more" if upward else "along every direction"
        check.problems.append(f"the expected log-likelihood is not peaked at the true candidate {where}: moving the "
                              "candidate does not lower it on average")
        return _conclude(check)
    kept = torch.nonzero(~flat).flatten()
    names = [names[j] for j in kept.tolist()]
    at = first[kept] if isinstance(first, Slopes) else \
        Moves.measure(defense, drawn, truth, like, unit[kept], 0.25 / curvature[kept].sqrt())
    check.problems += _statistical_problems(at, names, check, gen)
    return _conclude(check)


def _conclude(check: DefenseCheck) -> DefenseCheck:
    __tracebackhide__ = True
    if check.problems:
        raise AssertionError("\n".join(f"{check.defense}: {p}" for p in check.problems))
    return check
