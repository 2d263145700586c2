"""ATS (Gao et al. 2021): automatic transformation search, a defense by training-time augmentation.

The client trains on augmented images: a random crop (padding 4) and a horizontal flip, then one of the
searched augmentation policies, each a sequence of AutoAugment operations (Cubuk et al. 2019) with fixed
magnitudes. The update is the exact gradient at the augmented images, so what can leak is the augmented
image, and the attack is scored against it (Balunovic et al. 2022, Sec. 6 and A.2).

The 50 operations and their magnitudes are those of Gao et al.'s search space; a policy ``"7-4-15"``
applies operations 7, 4 and 15 in that order, and ``"21-13-3+7-4-15"`` picks one of the two per image.
As in their code, an operation in a policy is always applied (its AutoAugment probability is not used),
and a signed magnitude takes a random sign per image.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import Defense, SharedUpdate, cosine_distance

#: Gao et al.'s search space: (operation, magnitude), indexed as in their policy strings. Magnitudes are in
#: the operation's own unit: a fraction of the image side (translate), a shear factor, degrees (rotate), an
#: enhancement offset (factor 1 +- m), bits kept (posterize), a threshold in 0..256 (solarize).
OPERATIONS: tuple[tuple[str, float], ...] = (
    ("invert", 0), ("contrast", 1 / 3), ("rotate", 20 / 3), ("translateX", 150 / 331), ("sharpness", 1 / 18),
    ("sharpness", 1 / 6), ("shearY", 1 / 15), ("translateY", 100 / 993), ("autocontrast", 0), ("equalize", 0),
    ("shearY", 1 / 6), ("posterize", 6), ("color", 1 / 6), ("brightness", 5 / 18), ("sharpness", 1 / 2),
    ("brightness", 1 / 2), ("equalize", 0), ("equalize", 0), ("contrast", 7 / 18), ("sharpness", 5 / 18),
    ("color", 5 / 18), ("translateX", 250 / 993), ("equalize", 0), ("autocontrast", 0), ("translateY", 50 / 331),
    ("sharpness", 1 / 3), ("brightness", 1 / 3), ("color", 4 / 9), ("solarize", 256), ("invert", 0),
    ("equalize", 0), ("autocontrast", 0), ("equalize", 0), ("equalize", 0), ("color", 5 / 18),
    ("equalize", 0), ("autocontrast", 0), ("solarize", 256 * 5 / 9), ("brightness", 1 / 6), ("color", 0),
    ("solarize", 256 * 8 / 9), ("autocontrast", 0), ("translateY", 50 / 331), ("translateY", 50 / 331),
    ("autocontrast", 0), ("solarize", 256 * 8 / 9), ("equalize", 0), ("invert", 0), ("translateY", 50 / 331),
    ("autocontrast", 0),
)

#: The policies Balunovic et al. 2022 attack: the best three on ConvNet with CIFAR-100 in Gao et al. 2021.
PAPER_POLICIES = ("7-4-15", "21-13-3", "21-13-3+7-4-15")

#: Operations whose magnitude takes a random sign per image (the others are applied as given).
SIGNED = {"translateX", "translateY", "shearY", "color", "contrast", "sharpness", "brightness"}


def _tf():
    """torchvision's functional transforms, imported on first use (importing torchvision takes half a second)."""
    import torchvision.transforms.functional as tf

    return tf


def parse_policy(text: str) -> list[list[int]]:
    """``"21-13-3+7-4-15"`` as ``[[21, 13, 3], [7, 4, 15]]``; ValueError naming the bad part."""
    out = []
    for part in str(text).split("+"):
        try:
            ids = [int(i) for i in part.split("-")]
        except ValueError:
            raise ValueError(f"{text!r} is not a policy: write operation numbers joined by '-' "
                             f"(and alternatives by '+'), e.g. {PAPER_POLICIES[0]!r}") from None
        bad = [i for i in ids if not 0 <= i < len(OPERATIONS)]
        if bad:
            raise ValueError(f"policy {text!r}: operation {bad[0]} does not exist; choose 0..{len(OPERATIONS) - 1}")
        out.append(ids)
    return out


def _as_uint8(op: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``op`` on 8-bit pixels (PIL's posterize and equalize work on them), back to [0, 1]."""
    return lambda img: op((img * 255).round().to(torch.uint8)).float() / 255


def _translate(img: Tensor, dx: float, dy: float) -> Tensor:
    return _tf().affine(img, angle=0.0, translate=[round(dx), round(dy)], scale=1.0, shear=[0.0, 0.0], fill=0.0)


def apply_operation(img: Tensor, name: str, magnitude: float, sign: float) -> Tensor:
    """One operation on one image (C, H, W) in [0, 1]; ``sign`` is +1 or -1 for a signed magnitude."""
    m = sign * magnitude if name in SIGNED else magnitude
    side = img.shape[-1]
    if name == "translateX":
        return _translate(img, m * side, 0.0)
    if name == "translateY":
        return _translate(img, 0.0, m * side)
    if name == "shearY":  # about the centre (PIL shears about the corner: a shift of at most m * side / 2)
        return _tf().affine(img, angle=0.0, translate=[0, 0], scale=1.0, shear=[0.0, math.degrees(math.atan(m))],
                         interpolation=_tf().InterpolationMode.BILINEAR, fill=0.0)
    if name == "rotate":  # counter-clockwise, mid-grey corners
        return _tf().rotate(img, m, fill=[0.5] * img.shape[0])
    if name == "color":
        return _tf().adjust_saturation(img, 1 + m) if img.shape[0] == 3 else img
    if name == "contrast":
        return _tf().adjust_contrast(img, 1 + m)
    if name == "sharpness":
        return _tf().adjust_sharpness(img, 1 + m)
    if name == "brightness":
        return _tf().adjust_brightness(img, 1 + m).clamp(0, 1)
    if name == "posterize":
        return _as_uint8(lambda u: _tf().posterize(u, int(m)))(img)
    if name == "solarize":
        return img if m >= 256 else torch.where(img * 255 >= m, 1 - img, img)
    if name == "autocontrast":
        return _tf().autocontrast(img)
    if name == "equalize":
        return _as_uint8(_tf().equalize)(img)
    if name == "invert":
        return _tf().invert(img)
    raise ValueError(f"unknown operation {name!r}")


def random_crop_flip(img: Tensor, padding: int, dy: int, dx: int, flip: bool) -> Tensor:
    """A crop of the image's own size from the zero-padded image at offset (dy, dx), mirrored if ``flip``."""
    side_h, side_w = img.shape[-2:]
    padded = torch.nn.functional.pad(img, [padding] * 4)
    out = padded[..., dy:dy + side_h, dx:dx + side_w]
    return out.flip(-1) if flip else out


class ATS(Defense):
    """Gao et al. 2021: train on augmented images; the update is the exact gradient at the augmented batch."""

    name = "ats"
    modalities = ("image",)  # it augments pixels
    paper = "Gao et al. 2021"
    params = {
        "policy": Param("21-13-3+7-4-15", str, help="operation numbers joined by '-', alternatives by '+' (one "
                                                    f"per image); the paper's: {', '.join(PAPER_POLICIES)}"),
        "crop_padding": Param(4, int, min=0, help="random crop of the image's size from a zero padding "
                                                   "(0: no crop)"),
        "flip": Param(True, bool, help="random horizontal flip"),
    }
    policy: str
    crop_padding: int
    flip: bool

    def __init__(self, **settings) -> None:
        super().__init__(**settings)
        self.alternatives = parse_policy(self.policy)

    def augment(self, pixels: Tensor, generator: torch.Generator) -> Tensor:
        """Each image cropped, flipped and transformed by one of the policy's alternatives, with its own draws."""
        n, steps = len(pixels), max(map(len, self.alternatives))
        device = generator.device
        draws = torch.stack([
            torch.randint(2 * self.crop_padding + 1, (n,), generator=generator, device=device),
            torch.randint(2 * self.crop_padding + 1, (n,), generator=generator, device=device),
            torch.randint(2, (n,), generator=generator, device=device),
            torch.randint(len(self.alternatives), (n,), generator=generator, device=device),
        ]).tolist()  # one transfer for the whole batch: the operations take Python numbers
        signs = (torch.randint(2, (n, steps), generator=generator, device=device) * 2 - 1).tolist()
        out = []
        for i, img in enumerate(pixels):
            dy, dx, flip, which = (d[i] for d in draws)
            if self.crop_padding or self.flip:
                img = random_crop_flip(img, self.crop_padding, dy, dx, bool(flip) and self.flip)
            for k, op in enumerate(self.alternatives[which]):
                operation, magnitude = OPERATIONS[op]
                img = apply_operation(img, operation, magnitude, signs[i][k])
            out.append(img)
        return torch.stack(out)

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """Gaussian in cosine distance, ``-(1 - cos(g, g(x')))`` for the augmented image x' (Balunovic et al.
        2022, Table 6): the update is exact, so only its direction matters; its scale is the prior weight's."""
        return -cosine_distance(observed.tensors, candidate)


@hookimpl
def register_defenses():
    return [ATS]
