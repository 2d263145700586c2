"""``check_attack``: an attack on one undefended image under every protocol it does not refuse, which must
beat random noise under the first it accepts."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.authoring.cases import case_or_tiny, check_threat, seeded_generator
from leakaudit.evaluator.zoo.metrics import best_assignment, psnr
from leakaudit.plugins.attack import Attack, Problem, Reconstruction, solve
from leakaudit.plugins.protocol import FEDSGD, ClientStep, FedAvg, OwnStep, Protocol, trainable


#: How much better than random noise (in PSNR, dB) an attack must rebuild the undefended image.
BEATS_NOISE_DB = 1.0


@dataclass
class AttackCheck:
    """What ``check_attack`` measured: PSNR (dB) per protocol run, random noise's, and each refusal's reason."""

    attack: str
    noise_psnr: float
    psnr: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        scores = ", ".join(f"{k} {v:.1f}" for k, v in self.psnr.items())
        refused = "".join(f"; refuses {k}: {v}" for k, v in self.refused.items())
        return f"{self.attack}: PSNR {scores} dB; random noise {self.noise_psnr:.1f} dB{refused}"


def _sgd_step(model: nn.Module, inputs: Tensor, labels: Tensor) -> None:
    """A user's own training step, for ``protocol: step``: one plain SGD step at lr 0.1."""
    model.zero_grad()
    F.cross_entropy(model(inputs), labels).backward()
    with torch.no_grad():
        for p in trainable(model):
            assert p.grad is not None, "backward gave every trainable weight its gradient"
            p.sub_(0.1 * p.grad)


def _reconstruction_problems(rec: Reconstruction, pixels: Tensor, where: str) -> list[str]:
    if not isinstance(rec, Reconstruction):
        return [f"{where}: returned a {type(rec).__name__}, not a Reconstruction"]
    if rec.images.shape != pixels.shape:
        return [f"{where}: images of shape {tuple(rec.images.shape)} for targets of shape {tuple(pixels.shape)}"]
    problems = []
    if not torch.isfinite(rec.images).all() or rec.images.min() < 0 or rec.images.max() > 1:
        problems.append(f"{where}: images are not finite pixels in [0, 1]")
    if len(rec.labels) != len(pixels):
        problems.append(f"{where}: {len(rec.labels)} labels for {len(pixels)} images")
    return problems


#: The protocols ``check_attack`` tries: FedSGD, two local steps of FedAvg, and a user's own step.
CHECKED_PROTOCOLS: tuple[Protocol, ...] = (FEDSGD, FedAvg(local_epochs=2, local_lr=0.1), OwnStep(_sgd_step, 0.1))


def check_attack(attack: Attack, model: nn.Module | None = None, batch: tuple[Tensor, Tensor] | None = None, *,
                 known_labels: bool = False, seed: int = 0) -> AttackCheck:
    """Check that ``attack`` rebuilds an undefended image better than random noise; AssertionError if not.

    ``model`` and ``batch`` (pixels in [0, 1], labels) default to ``tiny_case(images=1)``. The attack runs
    under every protocol of ``CHECKED_PROTOCOLS`` it does not refuse, and must return a valid, reproducible
    reconstruction under each; under the first it accepts it must beat random noise by ``BEATS_NOISE_DB``.
    """
    __tracebackhide__ = True
    if isinstance(attack, type):
        raise TypeError(f"check_attack takes a configured attack, e.g. {attack.__name__}(iterations=...), not the class")
    model, (pixels, labels) = case_or_tiny(model, batch, images=1, seed=seed)
    model = model.to(pixels.device)
    noise = torch.rand(pixels.shape, generator=seeded_generator(pixels.device, seed), device=pixels.device)
    check = AttackCheck(repr(attack), float(psnr(noise, pixels).mean()))
    defense = NoDefense()
    for protocol in CHECKED_PROTOCOLS:
        why = attack.unsupported(model, len(pixels), protocol)
        if why:
            check.refused[protocol.name] = why
            continue
        observed = defense.share(ClientStep(model, F.cross_entropy, pixels, labels, seeded_generator(pixels.device, seed),
                                            protocol))
        threat = check_threat(model, pixels, labels, defense, protocol, known_labels)
        where = f"protocol {protocol.name}"
        try:
            runs = [solve([Problem(observed, threat, seeded_generator(pixels.device, seed), attack)])[0]
                    for _ in range(2)]
        except Exception as exc:  # an attack must refuse in unsupported() what it cannot do, not fail mid-audit
            check.problems.append(f"{where}: raised {type(exc).__name__}: {exc} (refuse what the attack cannot do "
                                  "in its unsupported())")
            continue
        found = _reconstruction_problems(runs[0], pixels, where)
        if not found and not torch.allclose(runs[0].images, runs[1].images, atol=1e-5):
            found.append(f"{where}: not reproducible: two runs from generators seeded alike differ; draw every "
                         "random number from the generator reconstruct() gets")
        check.problems += found
        if not found:
            order = best_assignment(runs[0].images, pixels)
            check.psnr[protocol.name] = float(psnr(runs[0].images[order], pixels).mean())
    if not check.psnr and not check.problems:
        check.problems.append("refuses every protocol tried: " + "; ".join(f"{k}: {v}" for k, v in check.refused.items()))
    first = next(iter(check.psnr.items()), None)
    if first is not None and first[1] < check.noise_psnr + BEATS_NOISE_DB:
        check.problems.append(f"protocol {first[0]}: PSNR {first[1]:.1f} dB on an undefended image, not "
                              f"{BEATS_NOISE_DB:g} dB above random noise's {check.noise_psnr:.1f} dB")
    check.problems += _auto_problems(type(attack))
    if check.problems:
        raise AssertionError("\n".join(f"{check.attack}: {p}" for p in check.problems))
    return check


def _auto_problems(cls: type[Attack]) -> list[str]:
    """What ``attacks: auto`` would refuse in the attack's declarations: budgets its parameters reject."""
    out = []
    for device, params in cls.auto_params.items():
        try:
            cls(**params)
        except Exception as exc:
            out.append(f"auto_params[{device!r}]: {params!r} is refused: {exc}")
    return out
