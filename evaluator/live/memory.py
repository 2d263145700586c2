"""The server's memory: a step's own gradient recovered from the optimizer's update and the updates before it.

A client whose optimizer keeps state (SGD's momentum, Adam's moments) sends updates that mix the step's gradient
with earlier ones, which blurs an attack on the update alone. A server that kept every update the client sent,
and knows its optimizer, undoes that mixing. For SGD it is exact: the momentum buffer before a step is the last
update divided by its learning rate, so ``g_t`` follows from ``delta_t`` and ``delta_(t-1)`` (weight decay,
dampening and Nesterov included). For Adam and AdamW the step is undone elementwise from the moments before it
(a quadratic per coordinate). That is not always exact: Adam's first step sends the gradient's sign, its
magnitudes lost to floating point (the first step is attacked as that sign), and a coordinate whose gradient is
near the scale of its history can have two gradients that give the same step (the one nearer the last mean
gradient is taken). A server tracks the moments by undoing each update in turn; the monitor reads them from the
optimizer before the audited step, the moments that tracking arrives at, so it measures the upper end of this
attacker. Other optimizers are attacked on the raw update, and the monitor says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


#: A root satisfies Adam's unsquared equation to this relative residual (float32 updates carry about 1e-7).
SATISFIES = 1e-4


@dataclass
class OptimizerMemory:
    """What the server knows of the client's optimizer just before one step: each parameter's settings (its
    param group's) and state (cloned), for ``recover`` to undo the step with."""

    kind: str
    settings: list[dict]
    state: list[dict[str, Tensor]]


def param_groups(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> list[dict]:
    """Each parameter's param group (its lr and the optimizer's other settings for it)."""
    group = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    return [group[id(p)] for p in params]


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the server cannot undo this optimizer's steps (the monitor then attacks the raw update); None if it can."""
    kind = type(optimizer).__name__
    if kind not in ("SGD", "Adam", "AdamW"):
        return f"{kind}'s update is not undone (SGD, Adam and AdamW are)"
    for g in optimizer.param_groups:
        if g.get("maximize"):
            return f"{kind}(maximize=True) is not undone"
        if kind == "SGD" and g.get("momentum") and g.get("dampening") == 1:
            return "SGD with dampening 1 adds nothing of the gradient after the first step"
        if kind != "SGD" and g.get("amsgrad"):
            return f"{kind}(amsgrad=True) is not undone"
        if kind != "SGD" and isinstance(g.get("lr"), Tensor):
            return f"{kind} with a tensor learning rate is not undone"
    return None


def remember(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> OptimizerMemory:
    """The optimizer's settings and state for ``params`` before its next step (``unsupported`` must be None)."""
    state = [{k: (v.detach().clone() if isinstance(v, Tensor) else torch.tensor(float(v)))
              for k, v in optimizer.state.get(p, {}).items()} for p in params]
    return OptimizerMemory(type(optimizer).__name__, [dict(s, params=None) for s in param_groups(optimizer, params)],
                           state)


def recover(memory: OptimizerMemory, before: list[Tensor], after: list[Tensor]) -> list[Tensor]:
    """The gradient each parameter's step was computed from, given its values before and after the step."""
    undo = _sgd if memory.kind == "SGD" else _adam
    return [undo(s, st, b.double(), a.double()).to(b.dtype)
            for s, st, b, a in zip(memory.settings, memory.state, before, after)]


def _sgd(group: dict, state: dict[str, Tensor], before: Tensor, after: Tensor) -> Tensor:
    """Undo ``torch.optim.SGD``: ``d = (before - after) / lr`` is the momentum buffer (or Nesterov's look-ahead)."""
    d = (before - after) / group["lr"]
    mu, tau, wd = group.get("momentum", 0.0), group.get("dampening", 0.0), group.get("weight_decay", 0.0)
    previous = state.get("momentum_buffer")
    if not mu:
        g = d
    elif previous is None:  # the first step: the buffer is the gradient itself, undamped
        g = d / (1 + mu) if group.get("nesterov") else d
    else:
        previous = previous.to(d)
        g = ((d - mu ** 2 * previous) / (1 + mu * (1 - tau)) if group.get("nesterov")
             else (d - mu * previous) / (1 - tau))
    return g - wd * before


def _adam(group: dict, state: dict[str, Tensor], before: Tensor, after: Tensor) -> Tensor:
    """Undo ``torch.optim.Adam`` / ``AdamW`` elementwise: solve ``r = (m / c1) / (sqrt(v / c2) + eps)`` for the
    gradient, where ``m`` and ``v`` are the moments after it, ``c1``, ``c2`` the bias corrections."""
    lr, wd, eps = group["lr"], group.get("weight_decay", 0.0), group["eps"]
    b1, b2 = group["betas"]
    decoupled = group["decoupled_weight_decay"]  # AdamW's (torch keeps it in both optimizers' groups)
    start = before * (1 - lr * wd) if decoupled else before
    t = float(state["step"]) + 1 if "step" in state else 1.0
    if t == 1:  # the first step sends g / (|g| + eps): the sign, its magnitudes lost to floating point
        return (start - after) / lr
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    m0 = state.get("exp_avg", torch.zeros_like(before)).to(before)
    v0 = state.get("exp_avg_sq", torch.zeros_like(before)).to(before)
    a = (start - after) / lr * c1  # = m / (sqrt(v / c2) + eps)
    g = _solve_moments(a, m0, v0, b1, b2, c2, eps, m0 / (1 - b1 ** (t - 1)))
    return g if decoupled else g - wd * before


def _solve_moments(a: Tensor, m0: Tensor, v0: Tensor, b1: float, b2: float, c2: float, eps: float,
                   expected: Tensor) -> Tensor:
    """The ``g`` with ``b1 m0 + (1 - b1) g = a (sqrt((b2 v0 + (1 - b2) g^2) / c2) + eps)``: a root of the squared
    equation (a quadratic in ``g``) that satisfies the unsquared one. Adam's step saturates for a gradient far
    larger than its history, so two roots can both satisfy it: the one nearer ``expected`` (the last mean
    gradient) is taken, as a server following a smooth training would."""
    c, shift = 1 - b1, b1 * m0 - a * eps
    qa = c ** 2 - a ** 2 * (1 - b2) / c2
    qb = 2 * c * shift
    qc = shift ** 2 - a ** 2 * b2 * v0 / c2
    root = (qb ** 2 - 4 * qa * qc).clamp_min(0).sqrt()
    linear = qa.abs() <= 1e-12 * (qb.abs() + qc.abs() + 1e-300)
    safe = torch.where(linear, torch.ones_like(qa), qa)
    candidates = torch.stack([(-qb + root) / (2 * safe), (-qb - root) / (2 * safe)])
    candidates = torch.where(linear, -qc / torch.where(qb == 0, torch.ones_like(qb), qb), candidates)

    def residual(g: Tensor) -> Tensor:
        right = a * (((b2 * v0 + (1 - b2) * g ** 2) / c2).sqrt() + eps)
        return (b1 * m0 + c * g - right).abs() / ((b1 * m0).abs() + (c * g).abs() + right.abs() + 1e-300)

    off = torch.stack([residual(g) for g in candidates])
    both = (off < SATISFIES).all(0)
    nearer = (candidates[1] - expected).abs() < (candidates[0] - expected).abs()
    pick = torch.where(both, nearer, off[1] < off[0])
    return torch.where(pick, candidates[1], candidates[0])
