"""Audit your own training as it runs: attach once, as Opacus's ``make_private`` does, and leave the loop as it is.

``LeakMonitor.attach(model, optimizer, loader)`` hooks the optimizer's step and the loader's batches. Every
``every`` steps it keeps the weights before the step and the batch it came from, and after the step attacks
the update the step really applied, ``(theta_before - theta_after) / lr`` (momentum, Adam state and weight
decay included), with the configured attacks; under an Opacus ``DPOptimizer`` that is the noised DP update,
attacked with ``dpsgd``'s likelihood. Rows, reconstructions and baselines go to a run folder as they are made,
which ``leakaudit report DIR`` renders like an audit's, leakage plotted against the training step.

Federated clients make their optimizer anew in each round: ``watch(loader)``, ``bind_rounds(model, loader)``
and ``with monitor.local_round(n): ...`` attack the round's ``theta_before - theta_after`` as FedAvg's, over
the batches the watched loader gave (``evaluator/live/flower.py`` wraps a Flower client with them).
"""
from __future__ import annotations

from leakaudit.evaluator.live.core import MAX_ROUND_IMAGES, MonitoredLoader
from leakaudit.evaluator.live.rounds import LocalRound, RoundMonitor
from leakaudit.evaluator.live.steps import StepMonitor

__all__ = ["LeakMonitor", "LocalRound", "MonitoredLoader", "MAX_ROUND_IMAGES"]


class LeakMonitor(StepMonitor, RoundMonitor):
    """Attack the update of every ``every``-th training step as your loop runs, and record how much leaks.

    ``defense`` and ``attacks`` take the names and mappings of an audit file's entries. ``defense`` is applied
    to the update your step made (``none``: it is attacked as it is sent); under Opacus the update is already
    DP-SGD's and the defense is ``dpsgd`` with your optimizer's noise multiplier and clipping norm.
    ``mean`` and ``std`` are your inputs' normalisation; left out, they are read from the loader's torchvision
    ``Normalize``, and a loader without one is refused rather than guessed. A loop whose items are token ids
    (a language model's) is audited as text: no normalisation, the text attacks and metrics, and ``vocabulary``
    (the token of each id), when given, shows the recovered sentences in words. Results go to ``out`` as they
    are made; a monitor attached again to the same folder with the same settings skips steps already there.

    ``attacker``: ``{memory: true}`` (the default) is a server that kept every update the client sent: it undoes
    the optimizer's mixing of earlier steps (SGD's momentum, Adam's moments; ``evaluator/live/memory.py``) and attacks
    the step's own gradient. ``{memory: false}`` attacks the update alone. Every audited step is also attacked on
    the undefended update, which calibrates its verdict (a "protects" where even that does not leak is
    inconclusive).
    """
