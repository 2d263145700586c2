"""Label recovery from the shared gradient of the last fully connected layer."""
from __future__ import annotations

import torch
from torch import Tensor

from defenses.base import SharedUpdate


def last_layer_gradients(update: SharedUpdate) -> tuple[Tensor, Tensor | None]:
    """The last 2-D tensor (the output layer's weight) and, if it directly follows, its bias."""
    tensors = update.tensors
    idx = max(i for i, t in enumerate(tensors) if t.dim() == 2)
    weight = tensors[idx]
    bias = tensors[idx + 1] if idx + 1 < len(tensors) and tensors[idx + 1].shape == weight.shape[:1] else None
    return weight, bias


def labels_from_signs(update: SharedUpdate, batch_size: int) -> Tensor:
    """Labels from the output layer's gradient under softmax cross-entropy.

    The bias gradient is mean(p - onehot(y)): only present classes can be negative,
    exact for one image (iDLG, Zhao et al. 2020). Without a bias, row sums of the
    weight gradient serve when features are non-negative. For a batch the
    ``batch_size`` most negative entries are taken (distinct labels; Yin et al. 2021).
    """
    weight, bias = last_layer_gradients(update)
    scores = bias if bias is not None else weight.sum(dim=1)
    return torch.argsort(scores)[:batch_size].sort().values
