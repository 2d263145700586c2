"""Attacks that take a fully connected layer's weight gradient apart into its per-example terms.

For a layer ``z = W x + b`` the batch's weight gradient is a sum of outer products, ``dL/dW = sum_i g_i x_i^T``
with ``g_i = dL/dz_i``, and the bias gradient is ``sum_i g_i``: a matrix of rank at most the batch size whose
row space holds the inputs. Two ways to split it:

- SPEAR (Dimitrov et al. 2024) uses the ReLU after the layer: each ``g_i`` is zero wherever example ``i`` left a
  unit inactive, so among the directions of the gradient's column space the true ``g_i`` are the sparse ones.
  Drawing rows of a rank-``b`` factor and taking the sparsest direction of what they annihilate finds them; the
  bias gradient fixes their scales, and the inputs follow exactly.
- spear_span takes the inputs out one by one at batches SPEAR's draws cannot reach: the inputs span the weight
  gradient's row space and their hidden activations the next fully connected layer's, so an input is a point of
  the first span whose activation lies in the second; many starts descend on that share at once, are solved
  exactly on their ReLU pattern, and each input found (with its output gradient's direction) narrows the search.
  Small noise only loosens the test to the noise's floor (SPEAR++'s setting, Bakarsky et al. 2025).
- The Cocktail Party attack (Kariyappa et al. 2023) treats the rows of the gradient as mixtures of the inputs,
  which are independent and far from Gaussian, and unmixes them by independent component analysis; it needs no
  activation and works on large batches and on the mean of many clients' updates (secure aggregation).

Both read the first layer of a model that sees the flattened image, so they recover the images themselves, in
one gradient step (FedSGD, or FedAvg with one local step per client, whatever the number of clients).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from leakaudit.attacks.labels import METHODS, labels_from_inputs, recover_labels
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.attack import Attack, Reconstruction, ThreatModel, generator_on, HONEST_SERVER
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import Protocol, not_one_step

LABEL_METHOD = Param("inputs", str, choices=("inputs", *METHODS),
                     help="labels: inputs (exact, from the recovered images and the output layer's gradient, "
                          "Ma et al. 2023), or a method of the other attacks")


def input_layer(model: nn.Module) -> tuple[str, nn.Linear, nn.Module | None]:
    """The model's first parametrised module when it is a Linear layer fed the flattened image, its name, and the
    module registered right after it (its activation in an ``nn.Sequential``)."""
    modules = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    first = next((i for i, (_, m) in enumerate(modules) if any(True for _ in m.parameters(recurse=False))), None)
    if first is None or not isinstance(modules[first][1], nn.Linear):
        raise ValueError("the model's first layer with parameters must be fully connected (nn.Linear on the "
                         "flattened image), as in the zoo's mlp")
    name, layer = modules[first]
    after = modules[first + 1][1] if first + 1 < len(modules) else None
    return name, layer, after


def _one_step_problem(name: str, model: nn.Module, batch_size: int, protocol: Protocol,
                      needs_relu: bool) -> str | None:
    """Why a decomposition attack cannot read this scenario's first layer, or None."""
    try:
        _, layer, after = input_layer(model)
    except ValueError as exc:
        return f"{name}: {exc}"
    if layer.bias is None:
        return f"{name}: the first fully connected layer has no bias, whose gradient fixes each input's scale"
    if not (layer.weight.requires_grad and layer.bias.requires_grad):
        return f"{name}: the first fully connected layer is frozen, so the update carries no gradient of it"
    if needs_relu and not isinstance(after, nn.ReLU):
        return f"{name}: the first fully connected layer must be followed by nn.ReLU, whose zeros it reads"
    if batch_size > min(layer.in_features, layer.out_features):
        return (f"{name}: {batch_size} images per update exceed the first layer's rank "
                f"(min of {layer.in_features} inputs, {layer.out_features} units)")
    return not_one_step(protocol, batch_size, name)


def layer_gradients(observed: SharedUpdate, threat: ThreatModel) -> tuple[Tensor, Tensor]:
    """The first layer's weight and bias gradients in float64 on the attack's device (their common scale,
    such as FedAvg's learning rate, cancels in both attacks)."""
    name, layer, _ = input_layer(threat.model)
    if layer.in_features != math.prod(threat.input_shape):
        raise ValueError(f"the first fully connected layer found ({name}) takes {layer.in_features} inputs, not the "
                         f"{math.prod(threat.input_shape)} of a flattened image {tuple(threat.input_shape)}")
    grads = dict(zip(observed.names, observed.tensors))
    return (grads[f"{name}.weight"].to(threat.device, torch.float64),
            grads[f"{name}.bias"].to(threat.device, torch.float64))


#: A direction counts as an example's once this share of the active units are zeros of it beyond those drawn
#: (an example leaves about half inactive; a random direction's extra zeros are units only one example uses).
MIN_ZERO_SHARE = 0.2
#: Angles within this many times the tolerance count as one, and so do zeros before a direction is polished.
LOOSE = 100
#: Planes drawn inside each mixture of examples to take it apart.
SPLIT_DRAWS = 256
#: spear_span claims nothing where ``LOOSE`` times the noise floor's share of the weight gradient (its first singular
#: value past the batch over its first) passes this share of an activation: measured on a 256-unit layer at 64
#: images, an input's activation then leaves the span by as much as other points of the span do.
MAX_SHARE = 0.05
#: Under noise an input's inactive units leave the weight gradient's basis with a near-null direction: its smallest
#: singular value there at most this share of the next (measured: inputs 0.4 at most, other points 0.6 and more).
NULL_GAP = 0.5
#: spear_span's measured reach at its CPU budget on Fashion-MNIST (``benchmarks/spear_span.py``): every input up to
#: this many times the square root of the first layer's units, and at most a few past it (256 units at 16 px: 64 of
#: 64, 9 of 72, none of 80; 512 at 28 px: 112 of 112, 1 of 128; 1,024 at 28 px: 128 of 128, 166 of 192, none of 256).
REACH_PER_ROOT_UNIT = 4.0


def low_rank(weight_grad: Tensor, rank: int) -> tuple[Tensor, Tensor, float, float]:
    """``weight_grad ~ L R`` with ``L`` (units, rank) and orthonormal rows ``R`` (rank, inputs), by the SVD; and the
    shares of the largest singular value held by the last one kept and by the first one past ``rank`` (an exact
    sum of ``rank`` independent outer products: the first well above 0, the second 0; a zero gradient: NaN)."""
    u, s, vh = torch.linalg.svd(weight_grad, full_matrices=False)
    last = float(s[rank - 1] / s[0]) if len(s) >= rank else 0.0
    rest = float(s[rank] / s[0]) if len(s) > rank else 0.0
    return u[:, :rank] * s[:rank], vh[:rank], last, rest


def null_planes(factor: Tensor, draws: int, generator: torch.Generator) -> Tensor:
    """For each of ``draws`` random choices of ``rank - 2`` rows of ``factor`` (units, rank), an orthonormal
    basis (rank, 2) of the plane those rows annihilate (the last columns of a complete QR of their transpose)."""
    rank = factor.shape[1]
    pick = torch.rand(draws, len(factor), generator=generator, device=factor.device).topk(rank - 2, dim=1).indices
    q, _ = torch.linalg.qr(factor[pick].transpose(1, 2), mode="complete")
    return q[..., -2:]


def sparsest_in_planes(factor: Tensor, planes: Tensor, tolerance: float, top: int = 1) -> Tensor:
    """The unit directions of each plane (draws, rank, 2) that the most rows of ``factor`` annihilate: the
    ``top`` sparsest of each plane, (draws * top, rank).

    A row ``l`` annihilates ``planes @ c`` where ``c`` is at right angles to ``l @ planes``; the rows of one
    example's zero set all give the same angle, so the longest run of equal angles, sorted, names it (rows that
    annihilate the whole plane take part in no run: in the plane of two examples they are the zeros both share).
    Sampling ``rank - 2`` rows and searching the plane they leave finds a direction where ``rank - 1`` rows
    would have to be drawn to pin it (Dimitrov et al. 2024 sample ``rank - 1``): a factor of the zero share
    fewer draws.
    """
    v = factor @ planes  # (draws, units, 2): each row's trace on each plane
    size = v.norm(dim=-1)
    angle = torch.atan2(v[..., 1], v[..., 0]).remainder(math.pi)
    flat = size <= tolerance * size.amax(dim=1, keepdim=True)
    angle = torch.where(flat, 4 + torch.arange(v.shape[1], device=v.device, dtype=angle.dtype), angle)
    angle = angle.sort(dim=1).values
    same = angle.diff(dim=1) <= tolerance * math.pi
    position = torch.arange(same.shape[1], device=factor.device).expand_as(same)
    start = torch.where(same, torch.full_like(position, -1), position).cummax(dim=1).values
    run = position - start  # the length of the run of equal angles ending at each position
    last = torch.cat([~same[:, 1:], torch.ones_like(same[:, :1])], dim=1)  # a run ends here
    end = torch.where(last, run, torch.zeros_like(run)).topk(top, dim=1).indices
    theta = angle.gather(1, end + 1) + math.pi / 2  # (draws, top): at right angles to each run's rows
    c = torch.stack([theta.cos(), theta.sin()], dim=-1).to(planes.dtype)  # (draws, top, 2)
    return (c @ planes.transpose(1, 2)).flatten(0, 1)


def split_mixture(factor: Tensor, direction: Tensor, tolerance: float, draws: int,
                  generator: torch.Generator) -> Tensor:
    """Sparser directions inside a mixture of examples: the space its zero rows annihilate holds each example
    of the mixture, and a plane of it through ``d - 2`` further random rows (``d`` its dimension) holds one of
    them whenever those rows are that example's zeros, which most draws are. Empty for a single example.

    Similar examples (two images of one digit) share most of their zeros, so a draw of shared zeros yields a
    mixture of them far more often than either example alone; this step takes such mixtures apart.
    """
    column = factor @ direction
    zeros = column.abs() <= tolerance * column.abs().max()
    _, s, vh = torch.linalg.svd(factor[zeros], full_matrices=True)
    rank = int((s > tolerance * s.max()).sum()) if len(s) else 0
    basis = vh[rank:].T  # (rank of factor, d): what the mixture's zero rows annihilate
    d = basis.shape[1]
    if d < 2:
        return basis.new_empty(0, factor.shape[1])
    if d == 2:  # the plane of two examples: its two longest runs
        return sparsest_in_planes(factor, basis[None], LOOSE * tolerance, top=2)
    rest = factor[~zeros] @ basis
    pick = torch.rand(draws, len(rest), generator=generator, device=factor.device).topk(d - 2, dim=1).indices
    q, _ = torch.linalg.qr(rest[pick].transpose(1, 2), mode="complete")
    return sparsest_in_planes(factor, basis @ q[..., -2:], LOOSE * tolerance)


def polish(factor: Tensor, directions: Tensor, tolerance: float) -> Tensor:
    """Each direction made exact: the null direction of the rows it nearly annihilates (within ``tolerance``
    of its largest entry), by the SVD, so that an angle read to a few digits gives a direction to all of them."""
    columns = directions @ factor.T
    near = columns.abs() <= tolerance * columns.abs().amax(dim=1, keepdim=True)
    return torch.linalg.svd(factor * near[..., None], full_matrices=False).Vh[:, -1]  # units >= rank: Vh square


def zero_counts(columns: Tensor, tolerance: float) -> Tensor:
    """Entries of each row of ``columns`` at most ``tolerance`` times that row's largest magnitude."""
    return (columns.abs() <= tolerance * columns.abs().amax(dim=-1, keepdim=True)).sum(dim=-1)


def independent_sparsest(directions: Tensor, zeros: Tensor, count: int) -> Tensor | None:
    """``count`` linearly independent directions (rows), the sparsest first; None when they span less."""
    chosen: list[int] = []
    for i in zeros.argsort(descending=True, stable=True).tolist():
        trial = directions[chosen + [i]]
        if torch.linalg.svdvals(trial)[-1] > 1e-6:
            chosen.append(i)
        if len(chosen) == count:
            return directions[chosen]
    return None


def spear_inputs(weight_grad: Tensor, bias_grad: Tensor, layer: nn.Linear, count: int, samples: int, chunk: int,
                 tolerance: float, generator: torch.Generator) -> tuple[Tensor | None, dict]:
    """The ``count`` inputs (count, inputs) of a linear-then-ReLU ``layer`` from its gradients (Dimitrov et al.
    2024): sparse directions of the weight gradient's column space are sampled until ``count`` of them give
    inputs whose units' signs match the zeros they were found by (the exactness check), or ``samples`` draws
    are spent. None where fewer than ``count`` directions came up, or where the gradient is not of rank
    ``count`` (a defense's noise, or repeated examples: the exact attack has nothing to read); with what the
    search saw."""
    full, rows, last, rest = low_rank(weight_grad, count)
    info: dict = {"draws": 0, "directions_found": 0, "exact": False}
    if not last > LOOSE * tolerance or not rest <= LOOSE * tolerance:
        # noise or more examples than said (no exact zeros to find), or fewer independent ones (no unique split)
        info["rank_shares"] = [last, rest]
        return None, info
    norms = full.norm(dim=1)
    factor = full[norms > tolerance * norms.max()]  # units no example activated are zero in every direction
    min_zeros = count - 2 + max(2, math.ceil(MIN_ZERO_SHARE * len(factor)))
    if count <= 2:  # the whole space is one plane: its sparsest directions are the examples'
        plane = sparsest_in_planes(factor, torch.eye(count, 2, dtype=factor.dtype, device=factor.device)[None],
                                   LOOSE * tolerance, top=count) if count == 2 else factor.new_ones(1, 1)
        plane = polish(factor, plane, LOOSE * tolerance) if count == 2 else plane
        pair, info["exact"] = _solve_inputs(full, rows, plane.T, bias_grad, layer, tolerance)
        info["directions_found"] = count
        return pair, info
    found = torch.empty(0, count, dtype=factor.dtype, device=factor.device)
    zeros = torch.empty(0, dtype=torch.long, device=factor.device)
    inputs: Tensor | None = None
    while info["draws"] < samples and len(factor) >= count - 2:
        draws = min(chunk, samples - info["draws"])
        q = sparsest_in_planes(factor, null_planes(factor, draws, generator), LOOSE * tolerance)
        info["draws"] += draws
        grew = False
        while len(q):  # few pass the filter: examples' directions and mixtures of similar examples
            q = q[zero_counts(q @ factor.T, LOOSE * tolerance) >= min_zeros]
            q = polish(factor, q, LOOSE * tolerance) if len(q) else q
            z = zero_counts(q @ factor.T, tolerance)
            q, z = q[z >= min_zeros], z[z >= min_zeros]
            q = q * q.gather(1, q.abs().argmax(dim=1, keepdim=True)).sign()  # one sign per direction
            new = []
            for direction, n in zip(q, z):
                if len(found) == 0 or (found @ direction).abs().max() < 1 - 1e-4:
                    found, zeros, grew = torch.cat([found, direction[None]]), torch.cat([zeros, n[None]]), True
                    new.append(split_mixture(factor, direction, tolerance, SPLIT_DRAWS, generator))
            q = torch.cat(new) if new else q[:0]
        if not grew or len(found) < count:
            continue
        chosen = independent_sparsest(found, zeros, count)
        if chosen is None:
            continue
        inputs, consistent = _solve_inputs(full, rows, chosen.T, bias_grad, layer, tolerance)
        if consistent:
            info["exact"] = True
            break
    info["directions_found"] = len(found)
    return inputs, info


def _solve_inputs(factor: Tensor, rows: Tensor, q: Tensor, bias_grad: Tensor, layer: nn.Linear,
                  tolerance: float) -> tuple[Tensor, bool]:
    """The inputs ``Q^-1 R`` for the directions ``q`` (rank, count) scaled by the bias gradient, and SPEAR's
    exactness check: every unit an input leaves inactive is a zero of its output gradient and the reverse."""
    outputs = factor @ q  # (units, count): each example's output gradient, up to its scale
    scales = torch.linalg.lstsq(outputs, bias_grad[:, None]).solution.squeeze(1)
    inputs = torch.linalg.solve(q * scales, rows)  # dL/dW = (L Q)(Q^-1 R)
    pre = inputs @ layer.weight.detach().to(inputs).T + layer.bias.detach().to(inputs)
    inactive = outputs.T.abs() <= tolerance * outputs.T.abs().amax(dim=1, keepdim=True)
    clear = pre.abs() > LOOSE * tolerance * pre.abs().amax(dim=1, keepdim=True)  # signs not lost to rounding
    return inputs, not bool((((pre > 0) == inactive) & clear).any())


def expected_draws(count: int) -> float:
    """About how many random row subsets SPEAR draws to find all ``count`` examples' directions: b 2^(b-2),
    as measured here (262,144 draws for 16 digits, docs/results.md)."""
    return count * 2.0 ** max(count - 2, 0)


class Spear(Attack):
    """Exact batch recovery from a linear-then-ReLU first layer (Dimitrov et al. 2024): the sparse directions of
    the weight gradient's column space are the examples' output gradients, and the inputs follow from them."""
    attacker = HONEST_SERVER

    name = "spear"
    paper = "Dimitrov et al. 2024"
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {}}
    brings = "exact recovery of a batch from a fully connected first layer followed by ReLU"
    noise_free_only = True
    params = {
        "samples": Param(4_000_000, int, min=1, max=100_000_000,
                         help="most random row subsets tried (about 2^b per image for b images per update)"),
        "chunk": Param(8192, int, min=1, max=1_000_000, help="row subsets solved together"),
        "tolerance": Param(1e-6, float, min=0.0, exclusive_min=True,
                           help="an entry counts as zero below this share of its column's largest"),
        "label_method": LABEL_METHOD,
    }
    samples: int
    chunk: int
    tolerance: float
    label_method: str

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        need = expected_draws(batch_size)
        if need > self.samples:
            return (f"{self.name}: {batch_size} images per update take about {need:.2g} draws to find "
                    f"(b 2^(b-2)), more than samples: {self.samples}; it reaches about 19 images at the default")
        return _one_step_problem(self.name, model, batch_size, protocol, needs_relu=True)

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        weight_grad, bias_grad = layer_gradients(observed, threat)
        _, layer, _ = input_layer(threat.model)
        inputs, info = spear_inputs(weight_grad, bias_grad, layer, threat.batch_size, self.samples, self.chunk,
                                    self.tolerance, generator_on(threat.device, generator))
        return _answer(self, observed, threat, generator, inputs, info)


def next_layer(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """The fully connected layer that reads the first layer's ReLU (the next parametrised module after it), with
    its name; None where the next one is not nn.Linear."""
    modules = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    first_name, _, _ = input_layer(model)
    after = [i for i, (n, _) in enumerate(modules) if n == first_name][0] + 1
    following = next(((n, m) for n, m in modules[after + 1:] if any(True for _ in m.parameters(recurse=False))), None)
    return following if following is not None and isinstance(following[1], nn.Linear) else None


def row_space(matrix: Tensor, rank: int) -> Tensor:
    """An orthonormal basis (columns) of the span of ``matrix``'s rows, from its ``rank`` leading singular vectors."""
    return torch.linalg.svd(matrix, full_matrices=False).Vh[:rank].T


def _off_span(h: Tensor, span: Tensor) -> Tensor:
    """Each row of ``h`` less its projection on the orthonormal columns of ``span``."""
    return h - (h @ span) @ span.T


def _descend(starts: Tensor, pre_w: Tensor, bias: Tensor, span: Tensor, steps: int, lr: float) -> Tensor:
    """Adam on many starts at once (rows of ``starts``, coordinates of candidate inputs): the share of each
    candidate's hidden activation ``relu(pre_w c + bias)`` outside ``span``, zero at every input of the batch."""
    c = starts.float().clone().requires_grad_(True)
    pre_w, bias, span = pre_w.float(), bias.float(), span.float()
    opt = torch.optim.Adam([c], lr=lr)
    for _ in range(steps):
        h = torch.relu(c @ pre_w.T + bias)
        loss = _off_span(h, span).pow(2).sum(1) / (h.pow(2).sum(1) + 1e-12)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
    return c.detach().to(starts.dtype)


def _snap(c: Tensor, pre_w: Tensor, bias: Tensor, span: Tensor, steps: int) -> tuple[Tensor, Tensor]:
    """Each candidate made exact where its units' pattern is right: with the pattern held, ``relu`` is linear, so
    the candidate whose activation lies in ``span`` is one least-squares solve (repeated ``steps`` times); with the
    pattern each last solve held."""
    active = torch.zeros(len(c), len(bias), dtype=torch.bool, device=c.device)
    for _ in range(steps):
        active = c @ pre_w.T + bias > 0
        dv, db = active[..., None] * pre_w, active * bias  # (K, units, d), (K, units)
        system = dv - span @ (span.T @ dv)
        c = torch.linalg.lstsq(system, -_off_span(db, span)[..., None]).solution[..., 0]
    return c, active


def span_inputs(weight_grad: Tensor, next_grad: Tensor, layer: nn.Linear, count: int, starts: int, steps: int,
                rounds: int, lr: float, tolerance: float, generator: torch.Generator) -> tuple[Tensor, dict]:
    """The inputs of a linear-then-ReLU ``layer`` found one by one from its weight gradient and the next layer's
    (``next_grad``), with what the search did (``found``: how many rows are inputs; ``exact``: all, to float
    precision).

    The inputs span the weight gradient's row space, and their hidden activations the next layer's: a candidate
    input there is one of the batch where its activation lies in the second span. Many starts descend on that
    share at once and are then solved exactly with their ReLU pattern held (a candidate whose pattern is right
    lands on an input to float precision, which the spans confirm). Each input found takes its output-gradient
    direction ``q_i`` with it (what its inactive units annihilate in the weight gradient's factor), and since the
    other inputs' coordinates are at right angles to it, the next round searches a space one smaller per input
    found: the found inputs' basins are gone, and the search narrows as it goes.

    Small noise (SPEAR++'s setting, Bakarsky et al. 2025) leaves the batch's rank as the leading singular
    directions, with a floor past them: the tolerance rises to that floor's share, so an input is accepted where
    its activation comes as close to the span as the noise allows and its inactive units still leave the factor a
    null direction; where the floor passes ``MAX_SHARE`` the noise hides the span and nothing is claimed.
    """
    factor, rows, _, rest = low_rank(weight_grad, count)
    # a floor past the batch's rank above the tolerance: noise, more examples than said, or nothing sent (NaN);
    # float32 rounding alone leaves it near 1e-8
    noisy = not rest <= tolerance
    info: dict = {"rounds": 0, "found": 0, "exact": False, "rank_share": rest}
    if noisy:
        if not LOOSE * rest <= MAX_SHARE:  # the noise hides the span: nothing to test against
            return weight_grad.new_zeros(count, weight_grad.shape[1]), info
        tolerance = rest
    span = row_space(next_grad, count)
    pre_w = layer.weight.detach().to(rows) @ rows.T  # (units, count): the layer on the row space's coordinates
    bias = layer.bias.detach().to(rows)
    found = rows.new_zeros(0, count)
    directions = rows.new_zeros(0, count)
    while info["rounds"] < rounds and len(found) < count:
        info["rounds"] += 1
        free = torch.linalg.svd(directions, full_matrices=True).Vh[len(directions):].T if len(directions) \
            else torch.eye(count, dtype=rows.dtype, device=rows.device)  # (count, d): where the rest lie
        if free.shape[1] == 0:
            break
        draws = torch.randn(starts, rows.shape[1], generator=generator, device=rows.device, dtype=rows.dtype)
        c = _descend(draws @ rows.T @ free, pre_w @ free, bias, span, steps, lr)
        c, active = _snap(c, pre_w @ free, bias, span, 5)
        found, directions = _accept(c @ free.T, active, pre_w, bias, span, factor, found, directions, tolerance,
                                    null_check=noisy)
    info["found"], info["exact"] = len(found), len(found) == count and not noisy
    inputs = torch.cat([found @ rows, rows.new_zeros(count - len(found), rows.shape[1])])
    return inputs, info


def _accept(candidates: Tensor, active: Tensor, pre_w: Tensor, bias: Tensor, span: Tensor, factor: Tensor,
            found: Tensor, directions: Tensor, tolerance: float, null_check: bool) -> tuple[Tensor, Tensor]:
    """``found`` and ``directions`` grown by the candidates that are inputs: activation in ``span`` to
    ``LOOSE * tolerance`` of its size, the pattern the last solve held, new, and with ``null_check`` (under noise,
    where it has as many inactive units as the batch has images) a near-null direction of ``factor``'s basis on
    its inactive units; each with what its inactive units annihilate. Without noise the span test alone decides:
    a batch of lower rank than its size (digits drawn up from 8 px) leaves a basis column of rounding, on which
    the check would fail its inputs."""
    pre = candidates @ pre_w.T + bias
    h = torch.relu(pre)
    share = _off_span(h, span).norm(dim=1) / h.norm(dim=1).clamp_min(torch.finfo(h.dtype).tiny)
    clear = pre.abs() > tolerance * pre.abs().amax(dim=1, keepdim=True)
    held = ((pre > 0) == active) | ~clear
    basis = factor / factor.norm(dim=0).clamp_min(torch.finfo(factor.dtype).tiny)  # its left singular vectors
    for i in torch.nonzero((share <= LOOSE * tolerance) & held.all(dim=1) & active.any(dim=1)).flatten().tolist():
        a = candidates[i]
        if len(found) == factor.shape[1]:
            break
        if len(found) and (found - a).norm(dim=1).min() <= LOOSE * tolerance * a.norm():
            continue
        inactive = pre[i] < 0
        if null_check and int(inactive.sum()) >= factor.shape[1] >= 2:
            s = torch.linalg.svdvals(basis[inactive])
            if s[-1] > NULL_GAP * s[-2]:  # no output gradient vanishes on its inactive units: not an input
                continue
        if int(inactive.sum()) < factor.shape[1] - 1:  # too few zeros to pin its direction: keep the input only
            direction = None
        else:
            direction = torch.linalg.svd(factor[inactive], full_matrices=True).Vh[-1]
        found = torch.cat([found, a[None]])
        if direction is not None:
            directions = torch.cat([directions, direction[None]])
    return found, directions


def edges(rows: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Each row's image (``shape``: channels, height, width) as its horizontal and vertical differences, flat."""
    images = rows.reshape(len(rows), *shape)
    return torch.cat([images.diff(dim=-1).flatten(1), images.diff(dim=-2).flatten(1)], dim=1)


def unmix_inputs(weight_grad: Tensor, bias_grad: Tensor, count: int, iterations: int, tolerance: float,
                 seed: int, shape: tuple[int, ...] | None = None, contrast: str = "logcosh") -> tuple[Tensor, dict]:
    """``count`` inputs (count, inputs) unmixed from the rows of a linear layer's weight gradient by FastICA
    (scikit-learn's, on the CPU: one small matrix per update), each scaled by the bias gradient.

    With unmixing ``C`` (count, units) of the rows ``dL/dW = G^T X``, ``C dL/dW = M^T X`` where ``M = G C^T``
    is, once separated, a permutation times a diagonal; ``C dL/db = M^T 1`` is that diagonal, so each unmixed
    row divided by its entry is one input with its sign, scale and mean restored (Kariyappa et al. 2023
    resolve them with image statistics instead).
    """
    from sklearn.decomposition import FastICA

    signals = weight_grad if shape is None else edges(weight_grad, shape)
    observed = signals.T.double().cpu().numpy()  # samples are the inputs' coordinates, features the units
    ica = FastICA(n_components=count, whiten="unit-variance", fun=contrast, max_iter=iterations, tol=tolerance,
                  random_state=seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ica.fit(observed)
    unmixing = torch.as_tensor(ica.components_, dtype=weight_grad.dtype, device=weight_grad.device)
    scales = unmixing @ bias_grad
    inputs = (unmixing @ weight_grad) / scales[:, None]
    return inputs, {"ica_iterations": int(ica.n_iter_), "converged": not any(
        "did not converge" in str(w.message) for w in caught)}


class CocktailParty(Attack):
    """The inputs of a fully connected first layer unmixed from its weight gradient by independent component
    analysis (Kariyappa et al. 2023): large batches and the mean of many clients' updates alike."""
    attacker = HONEST_SERVER

    name = "cocktail_party"
    paper = "Kariyappa et al. 2023"
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {}}
    brings = "large batches and the mean of many clients unmixed at a fully connected first layer"
    params = {
        "iterations": Param(1000, int, min=1, max=100_000, help="FastICA's most iterations"),
        "tolerance": Param(1e-4, float, min=0.0, exclusive_min=True, help="FastICA's convergence tolerance"),
        "contrast": Param("logcosh", str, choices=("logcosh", "exp", "cube"),
                          help="FastICA's measure of non-Gaussianity (scikit-learn's fun)"),
        "label_method": LABEL_METHOD,
    }
    iterations: int
    tolerance: float
    contrast: str
    label_method: str

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if batch_size < 2:
            return f"{self.name}: unmixing needs at least 2 images per update (use analytic for one)"
        return _one_step_problem(self.name, model, batch_size, protocol, needs_relu=False)

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        weight_grad, bias_grad = layer_gradients(observed, threat)
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=generator, device=generator.device))
        inputs, info = unmix_inputs(weight_grad, bias_grad, threat.batch_size, self.iterations, self.tolerance, seed,
                                    threat.input_shape, self.contrast)
        return _answer(self, observed, threat, generator, inputs, info)


def _answer(attack: Spear | SpearSpan | CocktailParty, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator,
            inputs: Tensor | None, info: dict) -> Reconstruction:
    """The reconstruction of recovered normalised ``inputs`` (the data's mean image where none came back)."""
    shape = (threat.batch_size, *threat.input_shape)
    normalised = torch.zeros(shape, device=threat.device) if inputs is None else \
        inputs.to(torch.float32).view(shape)
    labels = labels_from_inputs(observed, threat, normalised) \
        if attack.label_method == "inputs" and inputs is not None and info.get("found", len(inputs)) == len(inputs) \
        else None
    if labels is None:  # another method asked for, or no inputs to read the labels with
        method = "auto" if attack.label_method == "inputs" else attack.label_method
        labels = recover_labels(observed, threat, method, generator)
    return Reconstruction(threat.to_pixels(normalised), labels, [], 0.0, info)


class SpearSpan(Attack):
    """Exact inputs of a linear-then-ReLU first layer at large batches: each input is where its hidden activation
    lies in the next fully connected layer's gradient row space, found by many starts at once, solved exactly on
    its ReLU pattern, and taken out of the search once found (leakaudit's own search, built on SPEAR's low-rank
    view, Dimitrov et al. 2024); through small noise the found inputs are as close as the noise allows."""

    name = "spear_span"
    paper = "Dimitrov et al. 2024"
    attacker = HONEST_SERVER
    auto_params: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {"starts": 128, "rounds": 12}, "cuda": {}}
    brings = "exact inputs of a fully connected ReLU first layer at 64 and more images per update"
    noise_free_only = True
    params = {
        "starts": Param(256, int, min=1, max=1_000_000, help="candidate inputs searched together each round"),
        "steps": Param(200, int, min=0, max=100_000, help="Adam steps of each round before the exact solves"),
        "rounds": Param(16, int, min=1, max=1000, help="most rounds; each takes the inputs found out of the search",
                        budget=True),
        "lr": Param(0.05, float, min=0.0, exclusive_min=True, help="Adam's step size"),
        "tolerance": Param(1e-6, float, min=0.0, exclusive_min=True,
                           help="an input is exact where its activation leaves the span by 100 times this share"),
        "label_method": LABEL_METHOD,
    }
    starts: int
    steps: int
    rounds: int
    lr: float
    tolerance: float
    label_method: str

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        problem = _one_step_problem(self.name, model, batch_size, protocol, needs_relu=True)
        if problem is not None:
            return problem
        following = next_layer(model)
        if following is None:
            return f"{self.name}: the first layer's ReLU must feed a fully connected layer, whose gradient it reads"
        name, layer = following
        if not layer.weight.requires_grad:
            return f"{self.name}: the layer after the first ReLU ({name}) is frozen, so the update carries no gradient of it"
        if batch_size >= layer.out_features:
            return (f"{self.name}: {batch_size} images per update need more than the {layer.out_features} units of "
                    f"the layer after the first ReLU ({name}), whose gradient's row space tests each image's "
                    "activation (all of them it would pass anything)")
        return None

    def beyond_reach(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        units = input_layer(model)[1].out_features
        reach = int(REACH_PER_ROOT_UNIT * math.sqrt(units))
        if batch_size <= reach:
            return None
        return (f"{self.name}: {batch_size} images per update are past its measured reach on a first layer of {units} "
                f"units (about {REACH_PER_ROOT_UNIT:g}·sqrt(units) = {reach} images; docs/results.md)")

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        weight_grad, _ = layer_gradients(observed, threat)
        _, layer, _ = input_layer(threat.model)
        name, _ = next_layer(threat.model) or ("", None)
        next_grad = dict(zip(observed.names, observed.tensors))[f"{name}.weight"].to(threat.device, torch.float64)
        inputs, info = span_inputs(weight_grad, next_grad, layer, threat.batch_size, self.starts, self.steps,
                                   self.rounds, self.lr, self.tolerance, generator_on(threat.device, generator))
        return _answer(self, observed, threat, generator, inputs if info["found"] else None, info)


@hookimpl
def register_attacks():
    return [Spear, SpearSpan, CocktailParty]
