"""Label recovery from the shared update of the output layer (softmax cross-entropy).

For the output layer ``z = W h + b`` the bias gradient is ``mean_i(p_i - onehot(y_i))``
and the weight gradient ``mean_i (p_i - onehot(y_i)) h_i^T``; every method below
reads the labels (or their counts) from these two tensors.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.defense import SharedUpdate

METHODS = ("auto", "signs", "feature_fit", "geng")


def last_layer_gradients(update: SharedUpdate) -> tuple[Tensor, Tensor | None]:
    """The last 2-D tensor (the output layer's weight) and, if it directly follows, its bias."""
    tensors = update.tensors
    idx = max(i for i, t in enumerate(tensors) if t.dim() == 2)
    weight = tensors[idx]
    bias = tensors[idx + 1] if idx + 1 < len(tensors) and tensors[idx + 1].shape == weight.shape[:1] else None
    return weight, bias


def output_layer(model: nn.Module) -> nn.Linear:
    """The model's last fully connected layer."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("label recovery needs a final fully connected layer")
    return linears[-1]


def _mean_gradients(update: SharedUpdate, threat: ThreatModel) -> tuple[Tensor, Tensor | None]:
    """Output-layer tensors rescaled to a mean gradient (FedAvg sends lr * steps * ~gradient)."""
    w, b = last_layer_gradients(update)
    scale = threat.protocol.gradient_scale(threat.batch_size)
    if scale != 1.0:
        w, b = w * scale, (None if b is None else b * scale)
    return w, b


def labels_from_signs(update: SharedUpdate, batch_size: int) -> Tensor:
    """Labels from the signs of the output layer's gradient (iDLG; distinct labels in a batch).

    Only present classes can have a negative bias gradient: exact for one image
    (Zhao et al. 2020). Without a bias, row sums of the weight gradient serve when
    features are non-negative. For a batch the ``batch_size`` most negative entries
    are taken (Yin et al. 2021), so repeated labels are missed.
    """
    weight, bias = last_layer_gradients(update)
    scores = bias if bias is not None else weight.sum(dim=1)
    return torch.argsort(scores)[:batch_size].sort().values


def counts_to_labels(counts: Tensor, batch_size: int) -> Tensor:
    """Round estimated class counts to a label multiset of exactly ``batch_size`` (largest remainder first)."""
    remaining = counts.detach().clamp_min(0).clone()
    labels = []
    for _ in range(batch_size):
        c = int(torch.argmax(remaining))
        labels.append(c)
        remaining[c] -= 1
    return torch.tensor(sorted(labels), device=counts.device)


def feature_fit_counts(update: SharedUpdate, threat: ThreatModel, refinements: int = 3) -> Tensor:
    """Class counts from the output layer's own prediction of the batch's mean softmax.

    With near-uniform outputs ``gW ~= gb h^T`` for the batch's mean feature ``h``, so a
    rank-one least-squares fit gives ``h``, ``softmax(W h + b)`` the mean softmax, and
    ``n = B (mean_p - gb)`` the counts. Each refinement re-estimates every class's mean
    feature from ``gW_c = mean_p_c h - n_c h_c / B`` and averages their softmax outputs.
    In the family of iLRG (Ma et al. 2023): class embeddings read off the gradient,
    passed through the known output layer. Needs the output layer's bias gradient.
    """
    gw, gb = _mean_gradients(update, threat)
    if gb is None:
        raise ValueError("label method 'feature_fit' needs the output layer's bias gradient; use 'geng'")
    layer = output_layer(threat.model)
    w, bias, b = layer.weight.detach(), layer.bias.detach(), threat.batch_size
    with torch.no_grad():
        mean_feature = gw.T @ gb / (gb @ gb).clamp_min(1e-30)
        mean_p = torch.softmax(w @ mean_feature + bias, dim=0)
        counts = b * (mean_p - gb)
        for _ in range(refinements):
            n = counts.clamp_min(1e-3)
            class_features = (mean_p[:, None] * mean_feature[None] - gw) * b / n[:, None]
            mean_p = (n[:, None] * torch.softmax(class_features @ w.T + bias, dim=1)).sum(0) / n.sum()
            counts = b * (mean_p - gb)
    return counts


def _outputs_and_features(model: nn.Module, inputs: Tensor) -> tuple[Tensor, Tensor]:
    """The model's softmax outputs for ``inputs`` and the features its output layer received, without gradients."""
    captured: list[Tensor] = []
    handle = output_layer(model).register_forward_hook(lambda m, args, out: captured.append(args[0]))
    try:
        with torch.no_grad():
            probs = torch.softmax(model(inputs), dim=1)
    finally:
        handle.remove()
    return probs, captured[0]


def geng_counts(update: SharedUpdate, threat: ThreatModel, generator: torch.Generator, dummies: int = 64) -> Tensor:
    """Class counts from the mean softmax and feature sum of dummy inputs (Geng et al. 2021).

    ``gb_c = mean_p_c - n_c / B`` with the batch's mean softmax ``mean_p`` estimated
    on random inputs (an untrained network's outputs vary little); without a bias,
    the weight gradient's row sums divided by the dummies' mean feature sum.
    """
    gw, gb = _mean_gradients(update, threat)
    x = torch.randn((dummies, *threat.input_shape), generator=generator, device=threat.device)
    probs, features = _outputs_and_features(threat.model, x)
    mean_p = probs.mean(0)
    if gb is not None:
        return threat.batch_size * (mean_p - gb)
    feature_sum = features.sum(dim=1).mean()
    return threat.batch_size * (mean_p - gw.sum(dim=1) / feature_sum)


def labels_from_inputs(update: SharedUpdate, threat: ThreatModel, inputs: Tensor) -> Tensor | None:
    """Each recovered input's own label, exactly where the inputs are exact (the last step of iLRG, Ma et al.
    2023): the output layer's weight gradient is ``(P - Y)^T H / B`` with ``H`` and ``P`` the batch's features
    and softmax outputs, which the known model gives for the inputs, so ``P - Y`` is one least-squares solve.

    Labels in the inputs' order; None where the output layer takes fewer features than there are images (the
    solve would not be unique).
    """
    if threat.labels is not None:
        return threat.labels.to(threat.device)
    gw, _ = _mean_gradients(update, threat)
    probs, features = _outputs_and_features(threat.model, inputs.to(threat.device))
    probs, features = probs.double(), features.double().flatten(1)  # (B, classes), (B, d)
    if features.shape[1] < len(inputs):
        return None
    residual = torch.linalg.lstsq(features.T, len(inputs) * gw.double().T).solution  # (B, classes): P - Y
    return (probs - residual).argmax(dim=1)


def recover_labels(update: SharedUpdate, threat: ThreatModel, method: str, generator: torch.Generator) -> Tensor:
    """Known labels where the threat model grants them, else recovered with ``method`` (auto: signs for one
    image, feature_fit for a batch when the output layer has a bias, geng otherwise)."""
    if threat.labels is not None:
        return threat.labels.to(threat.device)
    b = threat.batch_size
    if method == "auto":
        method = "signs" if b == 1 else ("feature_fit" if last_layer_gradients(update)[1] is not None else "geng")
    if method == "signs":
        return labels_from_signs(update, b).to(threat.device)
    counts = feature_fit_counts(update, threat) if method == "feature_fit" else geng_counts(update, threat, generator)
    return counts_to_labels(counts, b).to(threat.device)
