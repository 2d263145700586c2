"""CI-Net (Zhang et al. 2023): a whole batch from one over-parameterised convolutional generator.

The generator maps fixed random latents (one per image) through a "linear to conv" layer and
blocks of nearest-neighbour upsampling, 3x3 convolution with spectral normalisation and
LeakyReLU, to a direct 3x3 output layer; its channel count is the smallest of a ladder whose
parameters outnumber the attacked model's. Only the generator's weights are trained, by
signed gradient steps on the squared distance between the batch's gradient and the observed
one, with labels read from the gradient (Zhang et al. 2023, Algorithm 1). The images share the
generator's convolutional prior, which is what helps at large batch sizes.
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
from leakaudit.plugins.attack import Attack, Reconstruction, ThreatModel
from leakaudit.plugins.defense import SharedUpdate, squared_distance

#: Channel counts tried, smallest first, until the generator has more parameters than the model.
CHANNEL_LADDER = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
START = 4  # side of the first feature map


class Generator(nn.Module):
    """Latents -> linear to conv -> [nearest x2, spectral-norm conv, LeakyReLU] blocks -> conv output."""

    def __init__(self, latents: Tensor, channels: int, out_channels: int, size: int) -> None:
        super().__init__()
        self.register_buffer("latents", latents)
        self.size, self.channels = size, channels
        self.to_conv = nn.Linear(latents.shape[1], channels * START * START)
        blocks: list[nn.Module] = []
        for _ in range(max(0, math.ceil(math.log2(size / START)))):
            blocks += [nn.Upsample(scale_factor=2, mode="nearest"),
                       spectral_norm(nn.Conv2d(channels, channels, 3, padding=1)), nn.LeakyReLU(0.2)]
        self.blocks = nn.Sequential(*blocks)
        self.out = nn.Conv2d(channels, out_channels, 3, padding=1)

    def forward(self) -> Tensor:
        x = self.to_conv(self.latents).view(-1, self.channels, START, START)
        x = self.out(self.blocks(x))
        if x.shape[-1] != self.size:
            x = F.interpolate(x, size=(self.size, self.size), mode="nearest")
        return x


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class CINet(Attack):
    """A convolutional generator trained by signed gradient steps to match the batch's gradient."""

    name = "cinet"
    paper = "Zhang et al. 2023"
    params = {
        "iterations": Param(2000, int, min=1, help="signed gradient steps on the generator"),
        "lr": Param(1e-3, float, min=0.0, exclusive_min=True, help="step size of the signed steps"),
        "lr_decay": Param(0.1, float, min=0.0, max=1.0, exclusive_min=True,
                          help="final step size as a fraction of the first (exponential decay)"),
        "latent": Param(128, int, min=1, help="latent size per image"),
        "channels": Param(None, int, min=1, help="generator channels (default: the smallest of "
                                                 f"{', '.join(map(str, CHANNEL_LADDER))} that outnumbers the model)"),
        "label_method": LABEL_METHOD,
    }

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        labels = recover_labels(observed, threat, self.label_method, generator)
        target = [t.to(threat.device) for t in observed.tensors]
        net = self.generator_for(threat, generator)
        params = list(net.parameters())
        schedule = self.lr_decay ** (1.0 / self.iterations)
        trace = torch.empty(self.iterations, device=threat.device)
        lo, hi = threat.box()
        step = self.lr
        for it in range(self.iterations):
            images = torch.maximum(torch.minimum(net(), hi), lo)
            loss = squared_distance(target, threat.candidate_update(images, labels))
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.sub_(step * g.sign())
            step *= schedule
            trace[it] = loss.detach()
        with torch.no_grad():
            images = torch.maximum(torch.minimum(net(), hi), lo)
        return Reconstruction(threat.to_pixels(images), labels, trace.tolist(), 0.0,
                              {"generator_parameters": parameter_count(net), "channels": net.channels})

    def generator_for(self, threat: ThreatModel, generator: torch.Generator) -> Generator:
        """The generator, its latents and initial weights drawn from ``generator`` (the attack's seed)."""
        target = parameter_count(threat.model)
        channels = self.channels or next((c for c in CHANNEL_LADDER if self._count(c, threat) > target),
                                         CHANNEL_LADDER[-1])
        latents = torch.randn((threat.batch_size, self.latent), generator=generator, device=threat.device)
        seed = int(torch.randint(2 ** 62, (1,), generator=generator, device=threat.device))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = Generator(latents, channels, threat.input_shape[0], threat.input_shape[1])
        return net.to(threat.device)

    def _count(self, channels: int, threat: ThreatModel) -> int:
        size = threat.input_shape[1]
        blocks = max(0, math.ceil(math.log2(size / START)))
        return (self.latent + 1) * channels * START * START + blocks * (9 * channels + 1) * channels \
            + (9 * channels + 1) * threat.input_shape[0]


@hookimpl
def register_attacks():
    return [CINet]
