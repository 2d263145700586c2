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

    Args:
        defense: the name or mapping of an audit file's ``defenses`` entry, applied to each audited update.
        attacks: the names or mappings of ``attacks`` entries.
        every: attack every ``every``-th step (or federated round).
        out: the run folder; results are written as they are made.
        mean: the images' normalisation (default: the loader's torchvision ``Normalize``).
        std: the images' normalisation (default: the loader's torchvision ``Normalize``).
        loss_fn: the training loss, ``loss_fn(outputs, labels)``.
        known_labels: give the attacker the labels.
        metrics: the scores to compute (default: the audit file's defaults for the inputs' kind).
        seed: the seed of the attacks' starts and the defense's noise.
        delta: the delta at which epsilon is reported under Opacus.
        name: the report's title.
        plugins_dirs: drop-in folders of plugin modules.
        attacker: ``{memory: true|false}``: whether the server undoes the optimizer (see above).
        leakage_metric: the metric the verdict is judged on (default: the audit file's default).
        prior: a dataset (or a loader over one) of the attacker's own items, for the guesses made without the
            update (default: the training set).
        eval_loader: held-out batches; each audited step's accuracy on them sets privacy against utility.
        loggers: where each audited step's scalars go: a TensorBoard ``SummaryWriter``, an object with
            ``log_metrics(metrics, step)`` (Lightning's loggers, mlflow) or a function ``(scalars, step)``.
        vocabulary: for a language model's loop, the token of each id, to show the recovered sentences in words.
        personal_values: for a language model's loop (with ``vocabulary``), a function that returns the personal
            values (names, phone and card numbers) a sentence holds, given its tokens joined by spaces; each row
            then carries PII recall, the share of them that came back verbatim.

    Raises:
        ConfigError: a bad setting, one line each, before any step (attaching checks the model and loader).

    Example:
        monitor = leakaudit.LeakMonitor(attacks=["inverting_gradients"], every=100, out="runs/training")
        model, optimizer, loader = monitor.attach(model, optimizer, loader)
        for inputs, labels in loader:  # your loop, unchanged
            optimizer.zero_grad()
            loss_fn(model(inputs), labels).backward()
            optimizer.step()
        summary = monitor.report()
    """
