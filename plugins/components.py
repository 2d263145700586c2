"""What the metric, model and dataset hooks return: small typed specs the engine reads its metadata from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import Tensor, nn

from leakaudit.plugins.spec import Param


class MetricUnavailable(RuntimeError):
    """The metric cannot be computed here (a weight file is missing); the message says what to do."""


@dataclass(frozen=True)
class Metric:
    """A named score. Image metrics map aligned (B, C, H, W) pairs to (B,); label metrics to a float.

    ``higher_is_better`` is the direction of leakage for a reconstruction score: the engine picks the
    strongest attack and draws its plots from it, never from a table of metric names. ``margin`` is how
    far, in the metric's units, an attack must beat the best guess made without the gradient before the
    report's verdict calls it a leak (an audit's ``verdict.margin`` overrides it).
    """

    name: str
    fn: Callable
    higher_is_better: bool
    on: str = "images"
    summary: str = ""
    min_size: int = 1  # smallest image side the metric can score (checked against data.image_size)
    margin: float = 0.0
    #: Rank as the report's second view of leakage beside the leakage metric (lower first; None: never): the
    #: worst case lists these where measured, and the privacy-utility figure draws the first as its second panel.
    view_rank: int | None = None
    #: Rank as the distance that names a reconstruction's nearest original (identifiability; lower first; None:
    #: never): the measured one of lowest rank, else the registered one of highest rank (the cheapest fallback).
    distance_rank: int | None = None
    #: The examples the metric scores: "image", "text", or "any" (label metrics).
    modality: str = "image"

    def better(self, a: float, b: float) -> bool:
        """Whether score ``a`` shows more leakage than ``b``."""
        return a > b if self.higher_is_better else a < b


@dataclass(frozen=True)
class ModelSpec:
    """A named model builder: ``build(channels=, num_classes=, image_size=, **params) -> nn.Module``."""

    name: str
    build: Callable[..., nn.Module]
    params: dict[str, Param] = field(default_factory=dict)
    summary: str = ""
    paper: str = ""
    #: What a malicious server changed in the model it sends (empty for an honest server's model): the report's
    #: threat box says it.
    malicious: str = ""
    #: The examples the model reads: "image" (built from channels, num_classes, image_size) or "text" (built from
    #: vocab_size, num_classes, length).
    modality: str = "image"
    #: What it learns: "classify" (a class per example) or, for text, "next_token" (a language model's next token
    #: at every position); the data's ``task`` must be the same.
    task: str = "classify"
    #: ``check(model_section) -> list[str]``: problems found before any work (a package the model needs, missing);
    #: validation puts the section's ``name`` key in front of each.
    check: Callable[[dict[str, Any]], list[str]] | None = None


@dataclass
class ImageData:
    """Train and test splits as tensors in [0, 1] pixel space, with the normalisation models see."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int
    mean: Tensor = field(init=False)
    std: Tensor = field(init=False)

    modality = "image"

    def __post_init__(self):
        dims = (0, 2, 3)
        self.mean = self.train_x.mean(dim=dims)
        self.std = self.train_x.std(dim=dims).clamp_min(1e-3)

    @property
    def channels(self) -> int:
        return self.train_x.shape[1]


@dataclass(frozen=True)
class DatasetSpec:
    """A named loader ``load(image_size=, root=, download=, **params) -> ImageData``.

    ``check(data_section) -> list[str]`` reports problems (a missing folder) before any work.
    ``values(data_section) -> int``: images x channels the loader keeps, so the memory a large
    ``image_size`` needs is estimated (and refused past the limit) before anything is loaded.
    """

    name: str
    load: Callable[..., ImageData]
    params: dict[str, Param] = field(default_factory=dict)
    summary: str = ""
    check: Callable[[dict[str, Any]], list[str]] | None = None
    values: Callable[[dict[str, Any]], int] | None = None
    #: The examples the loader returns: "image" (an ImageData) or "text" (a ``leakaudit.plugins.text.TokenData``).
    modality: str = "image"
