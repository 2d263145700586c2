"""Helpers shared by the defense families that act on one fully connected layer (soteria, precode)."""
from __future__ import annotations

from torch import nn

#: Ways to name a model's fully connected layer besides its module name.
LINEAR_BY_POSITION = {"largest": lambda linears: max(linears, key=lambda n: linears[n].weight.numel()),
                      "last": lambda linears: list(linears)[-1]}


def fully_connected_layer(model: nn.Module, name: str, who: str, key: str, special: str) -> str:
    """The module name of the fully connected layer ``name``, or of the ``special`` one (largest, last).

    ValueError, naming ``who``'s ``key`` and the choices, when there is no such layer.
    """
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if not linears:
        raise ValueError(f"{who}: the model has no fully connected (nn.Linear) layer")
    if name == special:
        return LINEAR_BY_POSITION[special](linears)
    if name not in linears:
        raise ValueError(f"{who}: {key} {name!r} is not a fully connected layer of the model; "
                         f"choices: {special}, {', '.join(linears)}")
    return name
