"""Learning to Invert (Wu et al. 2023): an inversion network trained on the attacker's own images.

The attacker draws batches of its own images (the training split, never a target), computes the update each
would send at the audited model's weights, passes it through the audited defense and protocol exactly as a
client does (``Defense.share``), and trains a network from those defended updates back to the images. The
network learns whatever the defense leaves, without a likelihood: it breaks defenses whose ``p(g|x)`` is
unknown, and works on trained models where gradient matching stalls.

As in the paper, the network is a multilayer perceptron with two hidden ReLU layers and a sigmoid output of
the whole batch, and it reads a fixed random subset of the update's coordinates (the paper's large models use
a hashed projection for the same purpose). The paper matches its outputs to a batch's images by the Hungarian
algorithm at every step; ours orders each batch canonically (by label, then by brightness) so that the loss
stays on the device, with no transfer per step. One network is trained per model, checkpoint and defense,
and reads every target update of that cell.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import Self

from leakaudit.attacks.gradient_matching import LABEL_METHOD
from leakaudit.attacks.labels import recover_labels
from leakaudit.attacks.vectorised import SharedModel, chunk_size
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.attack import Attack, Problem, Reconstruction, ThreatModel, generator_on, seed_from, HONEST_SERVER
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import ClientStep, FedSGD
from leakaudit.plugins.stochastic import stochastic_modules

#: Device types whose Adam has a fused step.
FUSED_ADAM = ("cpu", "cuda")
#: Batches whose simulated clean updates one vmapped pass computes (``chunk_for``; their per-batch gradients held at
#: once: this many times the model's size).
CHUNK = 32
#: Points of the training loss kept in the reconstruction's trace (its last fifth tells whether it still fell).
TRACE_POINTS = 100


def canonical_order(pixels: Tensor, labels: Tensor) -> Tensor:
    """The order the network is taught to give a batch's images in: by label, then by mean brightness."""
    key = labels.to(pixels.dtype) * 2 + pixels.flatten(1).mean(dim=1)  # brightness in [0, 1] breaks label ties
    return key.argsort()


def coordinates(observed: SharedUpdate, count: int, seed: int, device: torch.device) -> Tensor:
    """The ``count`` coordinates of the flattened update the network reads, drawn once per attack (all of them
    where the update has fewer), in increasing order."""
    size = sum(t.numel() for t in observed.tensors)
    if size <= count:
        return torch.arange(size, device=device)
    pick = torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:count]
    return pick.sort().values.to(device)


def flat_update(tensors: Sequence[Tensor], picked: Tensor) -> Tensor:
    """The picked coordinates of an update's tensors in float32, scaled to unit length: a trained model's updates
    differ in size by orders of magnitude between images it fits (the attacker's, from the training split) and
    images it has not seen (the targets), while their directions carry the images."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(torch.float32)[picked.to(tensors[0].device)]
    return flat / flat.norm().clamp_min(1e-30)


def vectorisable(threat: ThreatModel) -> bool:
    """Whether the simulated updates' clean parts may be computed many batches at once, the defense then applied
    to each in the loop's order: FedSGD's gradient, a model whose forward neither draws nor changes its state
    (no stochastic layers, no BatchNorm statistics or dropout in training), a defense that only perturbs it."""
    model, defense = threat.model, threat.defense
    stateful = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    return (type(threat.protocol) is FedSGD and not defense.shares_itself() and not defense.augments()
            and defense.client_loss(model, threat.loss_fn) is threat.loss_fn and not stochastic_modules(model)
            and not any(isinstance(m, stateful) and m.training for m in model.modules()))


def chunk_for(threat: ThreatModel, count: int) -> int:
    """Batches per pass of ``training_updates``: up to ``CHUNK`` where ``vectorisable``, as many as fit in free memory
    (the engine's rule for vmapped problems), but one (the loop) on a single CPU thread, where the loop is as fast
    (2,048 updates of cnn_bayes at 16 px, 16 images: 7.7 s looped, 7.6 to 8.3 s in chunks of 8 to 32; on two
    threads 6.2 s against 4.5)."""
    one_core = threat.device.type == "cpu" and torch.get_num_threads() == 1
    if one_core or not vectorisable(threat):
        return 1
    return min(CHUNK, chunk_size(None, threat, threat.batch_size, count))


def training_updates(threat: ThreatModel, picked: Tensor, count: int, generator: torch.Generator,
                     device_generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``count`` defended updates of batches of the attacker's own images (rows: the picked coordinates) and
    those batches' pixels in canonical order (rows: batch x channels x height x width, flat): in vmapped chunks
    (``chunk_for``), else one ``Defense.share`` at a time; the same draws from both generators either way. A
    model whose forward cannot be vmapped (a functional dropout, running statistics) takes the loop from there."""
    assert threat.auxiliary is not None  # _solve raises first where the attacker has no images
    chunk = chunk_for(threat, count)
    inputs: list[Tensor] = []
    targets: list[Tensor] = []
    while len(inputs) < count:
        drawn = [threat.auxiliary.draw(threat.batch_size, generator) for _ in range(min(chunk, count - len(inputs)))]
        pixels = torch.stack([p for p, _ in drawn]).to(threat.device)
        labels = torch.stack([y for _, y in drawn]).to(threat.device)
        updates = None
        if chunk > 1:
            try:
                updates = chunk_updates(threat, pixels, labels, device_generator)
            except RuntimeError:  # vmap refused the model's forward, or the chunk ran out of memory
                chunk = 1
        if updates is None:
            # one batch, or a chunk fallen back, whose defense draws nothing to augment: each draw in the loop's order
            pixels = torch.stack([threat.defense.augment(x, device_generator) for x in pixels])
            updates = [threat.defense.share(ClientStep(threat.model, threat.loss_fn, threat.normalise(x), y,
                                                       device_generator, threat.protocol)).tensors
                       for x, y in zip(pixels, labels)]
        inputs += [flat_update(u, picked) for u in updates]
        targets += [x[canonical_order(x, y)].flatten() for x, y in zip(pixels, labels)]
    return torch.stack(inputs), torch.stack(targets)


def chunk_updates(threat: ThreatModel, pixels: Tensor, labels: Tensor, device_generator: torch.Generator) -> list[list[Tensor]]:
    """The defended updates of a chunk of batches (chunk x batch x ...): every clean gradient in one vmapped pass,
    then ``Defense.apply`` on each in order, as ``Defense.share`` applies it."""
    shared = SharedModel.of(threat.model)

    def update(x: Tensor, y: Tensor) -> dict[str, Tensor]:
        return threat.protocol.functional_update(shared.module, shared.params, shared.buffers, threat.loss_fn, x, y)
    clean = torch.func.vmap(update)(threat.normalise(pixels), labels)
    return [threat.defense.apply([clean[n][i] for n in shared.params], device_generator)[0] for i in range(len(pixels))]


def inversion_network(inputs: int, width: int, outputs: int) -> nn.Sequential:
    """Wu et al.'s (2023) inversion network: two hidden ReLU layers, a sigmoid output in pixel space."""
    return nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, outputs), nn.Sigmoid())


def standard_deviations(inputs: Tensor) -> Tensor:
    """Each coordinate's spread over the training updates, as the network's inputs are scaled by: a coordinate
    that never moved there (a unit no image of the attacker's activated) is read as 0 (infinite spread), since a
    target's value there would otherwise be scaled by a vanishing spread into the network's garbage; one that
    barely moved is scaled as if it moved a hundredth of a typical coordinate."""
    std = inputs.std(dim=0)
    typical = std.mean()
    return torch.where(std > 1e-6 * typical, std.clamp_min(0.01 * typical), torch.full_like(std, math.inf))


def fit_inversion(inputs: Tensor, targets: Tensor, width: int, iterations: int, minibatch: int, lr: float,
                  generator: torch.Generator) -> tuple[nn.Sequential, Tensor, Tensor, list[float]]:
    """The network trained by Adam on the mean squared error from standardised ``inputs`` to ``targets`` (the
    step size falls tenfold at three quarters of the steps, as in the paper), the standardisation, and its
    training loss at ``TRACE_POINTS`` points."""
    mean, std = inputs.mean(dim=0), standard_deviations(inputs)
    scaled = (inputs - mean) / std
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_from(generator))
        net = inversion_network(inputs.shape[1], width, targets.shape[1]).to(inputs.device)
    # the fused step updates the network's millions of weights in one pass (a quarter of the time of the default
    # step on a CPU, where the step took as long as the forward and backward passes)
    optimiser = torch.optim.Adam(net.parameters(), lr=lr, fused=inputs.device.type in FUSED_ADAM)
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimiser, [int(0.75 * iterations)], gamma=0.1)
    every = max(1, iterations // TRACE_POINTS)
    losses = []
    for step in range(iterations):
        pick = torch.randint(0, len(scaled), (min(minibatch, len(scaled)),), generator=generator)
        pick = pick.to(inputs.device)
        loss = F.mse_loss(net(scaled[pick]), targets[pick])
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        schedule.step()
        if step % every == every - 1:
            losses.append(loss.detach())
    net.eval()
    return net, mean, std, [float(v) for v in torch.stack(losses).cpu()] if losses else []


class LearningToInvert(Attack):
    """An inversion network trained on the attacker's own images' defended updates (Wu et al. 2023): needs no
    likelihood of the defense, so it attacks any defense as the client applies it."""
    attacker = HONEST_SERVER

    name = "learning_to_invert"
    paper = "Wu et al. 2023"
    auto_params = {"cpu": {"updates": 2048, "iterations": 1500, "width": 500}, "cuda": {}}
    uses_defense = True
    learns_per_cell = True
    brings = "a data prior learned from the attacker's own images, for trained models"
    params = {
        "updates": Param(2048, int, min=16, max=10_000_000,
                         help="defended updates of the attacker's own images it learns from", budget=True),
        "coordinates": Param(8192, int, min=1, max=100_000_000,
                             help="random coordinates of the update the network reads (all, where fewer)"),
        "width": Param(1000, int, min=1, max=100_000, help="units of each of the network's two hidden layers"),
        "iterations": Param(1500, int, min=1, max=10_000_000, help="Adam steps training the network",
                            budget=True),
        "minibatch": Param(64, int, min=1, max=100_000, help="updates per training step"),
        "lr": Param(1e-3, float, min=0.0, exclusive_min=True, help="Adam's step size (a tenth from 3/4 of the steps)"),
        "label_method": LABEL_METHOD,
    }
    updates: int
    coordinates: int
    width: int
    iterations: int
    minibatch: int
    lr: float
    label_method: str

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        return self.reconstruct_all([Problem(observed, threat, generator, self)])[0]

    @classmethod
    def reconstruct_all(cls, problems: list[Problem[Self]], max_problems: int | None = None) -> list[Reconstruction]:
        """One network per model, defense and attack setting (a cell's updates share them), trained from the
        first such problem's generator, then read on every update."""
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(problems):
            key = (id(p.threat.model), id(p.threat.defense), p.threat.batch_size, repr(sorted(p.attack.settings.items())))
            groups.setdefault(key, []).append(i)
        out: list[Reconstruction | None] = [None] * len(problems)
        for members in groups.values():
            first = problems[members[0]]
            for i, rec in zip(members, first.attack._solve([problems[i] for i in members])):
                out[i] = rec
        return out  # type: ignore[return-value]

    def _solve(self, problems: list[Problem[Self]]) -> list[Reconstruction]:
        first = problems[0]
        threat = first.threat
        if threat.auxiliary is None or len(threat.auxiliary) < threat.batch_size:
            have = 0 if threat.auxiliary is None else len(threat.auxiliary)
            raise ValueError(f"{self.name} learns from the attacker's own images (ThreatModel.auxiliary): it has {have}, "
                             f"needs at least {threat.batch_size}")
        start = time.perf_counter()
        cpu = generator_on(torch.device("cpu"), first.generator)
        picked = coordinates(first.observed, self.coordinates, seed_from(cpu), threat.device)
        inputs, targets = training_updates(threat, picked, self.updates, cpu, generator_on(threat.device, cpu))
        net, mean, std, trace = fit_inversion(inputs, targets, self.width, self.iterations, self.minibatch, self.lr, cpu)
        shared = (time.perf_counter() - start) / len(problems)
        out = []
        for p in problems:
            with torch.no_grad():
                pixels = net((flat_update(p.observed.tensors, picked).to(threat.device) - mean) / std)
            pixels = pixels.view(p.threat.batch_size, *p.threat.input_shape)
            labels = recover_labels(p.observed, p.threat, self.label_method, p.generator)
            out.append(Reconstruction(pixels, labels, trace, shared,
                                      {"training_loss": trace[-1] if trace else math.nan}))
        return out


@hookimpl
def register_attacks():
    return [LearningToInvert]
