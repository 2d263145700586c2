"""Utility: the model trained under the audited defense, checkpointed for the attacks, scored on test data."""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from leakaudit.defenses.noise import NoDefense
from leakaudit.evaluator.audit.seeds import derive_seed, generator
from leakaudit.evaluator.audit.types import DefenseSetting
from leakaudit.evaluator.run.scenario import Scenario, loss_fn
from leakaudit.plugins.defense import Defense
from leakaudit.plugins.protocol import TrainingRun, opacus_sample_rate
from leakaudit.plugins.text import IGNORE


@torch.no_grad()
def accuracy(model: nn.Module, scenario: Scenario, batch: int = 256) -> float:
    """Top-1 accuracy on the test split: of its classes, or of a language model's next tokens (the positions that
    have one: a keyboard's top-1 word accuracy)."""
    data = scenario.data
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(data.test_x), batch):
        x = scenario.normalise(data.test_x[i:i + batch].to(scenario.device))
        correct += (model(x).argmax(1) == data.test_y[i:i + batch].to(scenario.device)).sum()
    model.train(was_training)
    return float(correct) / int((data.test_y != IGNORE).sum())


def training_run(scenario: Scenario, setting: DefenseSetting, steps: int, defense: Defense) -> TrainingRun:
    """The utility training of one defense setting: the whole training split, normalised, on the device,
    each batch through ``defense.augment`` when the defense augments."""
    audit, data, cfg = scenario.audit, scenario.data, scenario.audit.utility
    noise = generator(scenario.device, audit.seed, "utility", setting.identity)

    def augmented(inputs: Tensor) -> Tensor:
        return scenario.normalise(defense.augment(scenario.denormalise(inputs), noise))

    return TrainingRun(
        inputs=scenario.normalise(data.train_x.to(scenario.device)), labels=data.train_y.to(scenario.device),
        loss_fn=loss_fn, steps=steps, batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum,
        batch_generator=torch.Generator().manual_seed(derive_seed(audit.seed, "batches")),
        noise_generator=noise, protocol=audit.protocol, transform=augmented if defense.augments() else None)


def privacy_spent(scenario: Scenario, defense: Defense) -> float | None:
    """Epsilon at ``utility.delta`` after the utility training (None: no formal guarantee, no training, or
    training that did not run under the defense).

    The sample rate is Opacus's, 1 / ceil(train size / batch size), so the figure is the one
    Opacus's PrivacyEngine reports for the same training.
    """
    cfg = scenario.audit.utility
    if cfg.train_steps == 0 or not cfg.train_defended:
        return None
    rate = opacus_sample_rate(len(scenario.data.train_x), cfg.batch_size)
    return defense.privacy_spent(cfg.train_steps, rate, cfg.delta)


def train_under_defense(scenario: Scenario, setting: DefenseSetting) -> dict[str, Any]:
    """Train under the defense (``Defense.train``) and keep what the audit needs.

    Returns the model's state at each audited checkpoint and test accuracy at each
    checkpoint and at the end of ``utility.train_steps``.
    """
    audit, cfg = scenario.audit, scenario.audit.utility
    start = time.perf_counter()
    defense = scenario.defense(setting)
    model = scenario.fresh_model(defense, setting)
    total = max(cfg.train_steps, max(audit.checkpoints))
    states: dict[int, dict] = {}
    accuracies: dict[int, float] = {}
    # utility.train_defended: false trains as the undefended baseline does (plain SGD on clean updates)
    trainer = defense if cfg.train_defended else NoDefense()
    for step, current in enumerate(trainer.train(model, training_run(scenario, setting, total, trainer))):
        if step in audit.checkpoints:
            states[step] = {k: v.detach().clone() for k, v in current.state_dict().items()}
        if step in audit.checkpoints or step == cfg.train_steps:
            accuracies[step] = accuracy(current, scenario)
    final = accuracies[cfg.train_steps] if cfg.train_steps > 0 else None
    return {"setting": setting.key, "defense": setting.name, "params": setting.params, "accuracy": final,
            "train_steps": cfg.train_steps, "train_defended": cfg.train_defended,
            "epsilon": privacy_spent(scenario, defense), "delta": cfg.delta,
            "model_changes": defense.model_changes,
            "checkpoint_accuracy": {str(k): accuracies[k] for k in audit.checkpoints},
            "test_images": len(scenario.data.test_x), "seconds": time.perf_counter() - start, "states": states}
