"""Utility: the model trained under the audited defense, checkpointed for the attacks, scored on test data."""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from evaluator.protocol import ClientStep, trainable
from evaluator.scenario import Scenario, derive_seed, generator, loss_fn
from defenses.base import Defense
from evaluator.config import DefenseSetting


@torch.no_grad()
def accuracy(model: nn.Module, scenario: Scenario, batch: int = 256) -> float:
    """Top-1 accuracy on the test split."""
    data = scenario.data
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(data.test_x), batch):
        x = scenario.normalise(data.test_x[i:i + batch].to(scenario.device))
        correct += (model(x).argmax(1) == data.test_y[i:i + batch].to(scenario.device)).sum()
    model.train(was_training)
    return float(correct) / len(data.test_x)


def privacy_spent(scenario: Scenario, defense: Defense) -> float | None:
    """Epsilon at ``utility.delta`` after the utility training's steps at its sample rate (None: no guarantee)."""
    cfg = scenario.audit.utility
    rate = min(1.0, cfg["batch_size"] / len(scenario.data.train_x))
    return defense.privacy_spent(cfg["train_steps"], rate, cfg["delta"]) if cfg["train_steps"] > 0 else None


def train_under_defense(scenario: Scenario, setting: DefenseSetting) -> dict[str, Any]:
    """SGD on the training split where every step applies the defended update.

    Returns the model's state at each audited checkpoint and test accuracy at each
    checkpoint and at the end of ``utility.train_steps``.
    """
    audit = scenario.audit
    cfg = audit.utility
    start = time.perf_counter()
    defense = scenario.defense(setting)
    model = scenario.fresh_model(defense)
    model.train()
    optimiser = torch.optim.SGD(trainable(model), lr=cfg["lr"], momentum=cfg["momentum"])
    data = scenario.data
    sampler = torch.Generator().manual_seed(derive_seed(audit.seed, "batches"))
    noise = generator(scenario.device, audit.seed, "utility", setting.key)
    total = max(cfg["train_steps"], max(audit.checkpoints))
    states: dict[int, dict] = {}
    accuracies: dict[int, float] = {}
    for step in range(total + 1):
        if step in audit.checkpoints:
            states[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if step in audit.checkpoints or step == cfg["train_steps"]:
            accuracies[step] = accuracy(model, scenario)
        if step == total:
            break
        idx = torch.randint(len(data.train_x), (cfg["batch_size"],), generator=sampler)
        x = scenario.normalise(data.train_x[idx].to(scenario.device))
        y = data.train_y[idx].to(scenario.device)
        update = defense.share(ClientStep(model, loss_fn, x, y, noise))
        for p, g in zip(trainable(model), update.tensors):
            p.grad = g
        optimiser.step()
    final = accuracies[cfg["train_steps"]] if cfg["train_steps"] > 0 else None
    return {"setting": setting.key, "defense": setting.name, "params": setting.params, "accuracy": final,
            "train_steps": cfg["train_steps"], "epsilon": privacy_spent(scenario, defense), "delta": cfg["delta"],
            "model_changes": getattr(defense, "model_changes", []), "checkpoint_accuracy": {str(k): accuracies[k] for k in audit.checkpoints},
            "seconds": time.perf_counter() - start, "states": states}
