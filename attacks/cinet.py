"""CI-Net (Zhang et al. 2023): a whole batch from one over-parameterised convolutional generator.

The generator follows the authors' released code: one latent per image, a transposed convolution to a
4x4 map with BatchNorm and LeakyReLU(0.1), then at each scale (4, 8, 16, 32 px, nearest-neighbour
upsampling between scales) two spectral-norm 3x3 convolutions with BatchNorm and LeakyReLU(0.1), and a
1x1 convolution to the image channels with tanh, mapped onto the pixel range [0, 1]. Its width starts at
32 and doubles while the generator keeps at most 4·B·H·W parameters. Only the generator's weights are
trained, by Adam on the sign of their gradient (no decay), on the cosine distance between the batch's
update and the observed one, with no image prior; labels are read from the gradient.

The supplement's Algorithm 1 states a squared-L2 loss, plain signed steps and a width chosen so that the
generator outnumbers the model; the code the authors released (and this module) differ on all three.
The images share the generator's convolutional prior, which is what helps at large batch sizes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm

from leakaudit.attacks.gradient_matching import LABEL_METHOD
from leakaudit.attacks.labels import recover_labels
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.attack import MAX_ITERATIONS, Attack, Reconstruction, ThreatModel, HONEST_SERVER
from leakaudit.plugins.defense import SharedUpdate, cosine_distance

START = 4  # side of the first feature map
FIRST_WIDTH = 32  # the width rule's first value, doubled while the generator stays within its budget
PARAMETERS_PER_VALUE = 4  # the width rule's budget: this many generator parameters per pixel value of the batch
SLOPE = 0.1  # LeakyReLU's negative slope


def scales(size: int) -> int:
    """Number of feature-map sides 4, 8, 16, ... up to the first at least ``size``."""
    return 1 + max(0, math.ceil(math.log2(size / START)))


def _block(width: int) -> list[nn.Module]:
    return [spectral_norm(nn.Conv2d(width, width, 3, padding=1)), nn.BatchNorm2d(width), nn.LeakyReLU(SLOPE)]


class Generator(nn.Module):
    """Latents -> transposed conv to 4x4 -> [two spectral-norm conv-BN-LeakyReLU per scale] -> 1x1 conv."""

    def __init__(self, latents: Tensor, width: int, out_channels: int, size: int) -> None:
        super().__init__()
        self.register_buffer("latents", latents[:, :, None, None])
        self.size, self.width = size, width
        layers: list[nn.Module] = [nn.ConvTranspose2d(latents.shape[1], width, START), nn.BatchNorm2d(width),
                                   nn.LeakyReLU(SLOPE)]
        for scale in range(scales(size)):
            if scale:
                layers.append(nn.Upsample(scale_factor=2, mode="nearest"))
            layers += _block(width) + _block(width)
        layers.append(nn.Conv2d(width, out_channels, 1))
        self.body = nn.Sequential(*layers)

    def logits(self) -> Tensor:
        """The output before tanh, resized to the image side where the last scale overshoots it."""
        x = self.body(self.latents)
        return x if x.shape[-1] == self.size else F.adaptive_avg_pool2d(x, self.size)

    def forward(self) -> Tensor:
        """The batch in pixel range [0, 1]."""
        return (torch.tanh(self.logits()) + 1) / 2


def generator_parameters(width: int, latent: int, channels: int, size: int) -> int:
    """Trainable parameters of a ``Generator`` (spectral norm adds buffers, not parameters)."""
    conv = 9 * width * width + width + 2 * width
    return (latent * START * START * width + width + 2 * width) + 2 * scales(size) * conv + width * channels + channels


def width_for(batch: int, channels: int, size: int, latent: int) -> int:
    """The authors' rule: start at 32 and double while the generator has at most 4·B·H·W parameters."""
    budget = PARAMETERS_PER_VALUE * batch * size * size
    width = FIRST_WIDTH
    while generator_parameters(2 * width, latent, channels, size) <= budget:
        width *= 2
    return width


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class CINet(Attack):
    """A convolutional generator trained by Adam on signed gradients to match the batch's update in cosine."""
    attacker = HONEST_SERVER

    name = "cinet"
    paper = "Zhang et al. 2023"
    auto_params = {"cpu": {"iterations": 1000}, "cuda": {"iterations": 2000}}
    brings = "a convolutional generator's prior shared by a large batch"
    params = {
        "iterations": Param(2000, int, min=1, max=MAX_ITERATIONS,
                            help="Adam steps on the generator (the last iterate is reported)", budget=True),
        "lr": Param(1e-3, float, min=0.0, exclusive_min=True, help="Adam's step size on the signed gradient"),
        "latent": Param(128, int, min=1, help="latent size per image"),
        "width": Param(None, int, min=1, help=f"generator channels (default: {FIRST_WIDTH}, doubled while the "
                                              f"generator has at most {PARAMETERS_PER_VALUE}·B·H·W parameters)"),
        "label_method": LABEL_METHOD,
    }
    iterations: int
    lr: float
    latent: int
    width: int | None
    label_method: str

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        labels = recover_labels(observed, threat, self.label_method, generator)
        target = [t.to(threat.device) for t in observed.tensors]
        net = self.generator_for(threat, generator)
        trace = self.train_generator(net, target, threat, labels)
        with torch.no_grad():
            pixels = net()
        return Reconstruction(pixels, labels, trace.tolist(), 0.0,
                              {"generator_parameters": parameter_count(net), "width": net.width})

    def train_generator(self, net: Generator, target: list[Tensor], threat: ThreatModel, labels: Tensor) -> Tensor:
        """``iterations`` Adam steps on the sign of the cosine loss's gradient; returns the loss trace."""
        params = list(net.parameters())
        optimiser = torch.optim.Adam(params, lr=self.lr, foreach=True)
        trace = torch.empty(self.iterations, device=threat.device)
        for it in range(self.iterations):
            loss = cosine_distance(target, threat.candidate_update(threat.normalise(net()), labels))
            grads = torch.autograd.grad(loss, params)
            for p, g in zip(params, grads):
                p.grad = g.sign()
            optimiser.step()
            trace[it] = loss.detach()
        return trace

    def generator_for(self, threat: ThreatModel, generator: torch.Generator) -> Generator:
        """The generator, its latents and initial weights drawn from ``generator`` (the attack's seed)."""
        channels, size = threat.input_shape[0], threat.input_shape[1]
        width = self.width or width_for(threat.batch_size, channels, size, self.latent)
        latents = torch.randn((threat.batch_size, self.latent), generator=generator, device=threat.device)
        seed = int(torch.randint(2 ** 62, (1,), generator=generator, device=threat.device))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = Generator(latents, width, channels, size)
        return net.to(threat.device)


@hookimpl
def register_attacks():
    return [CINet]
