"""Monitoring a training loop step by step: the optimizer's hooks, the update each audited step applied, and
what Opacus's DPOptimizer makes of it."""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from leakaudit.evaluator.live.core import MonitorCore, MonitoredLoader, inputs_labels, joined, model_state
from leakaudit.evaluator.live.memory import OptimizerMemory, param_groups, recover, remember, unsupported
from leakaudit.evaluator.results.rundir import MONITOR, RunError
from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.protocol import FEDSGD, trainable


@dataclass
class _Pending:
    """One audited step in flight: the weights and buffers before it, the batch it came from, and the optimizer's
    state before it (None when the attacker keeps no memory, or cannot undo this optimizer)."""

    step: int
    before: list[Tensor]
    buffers: dict[str, Tensor]
    batch: Any
    memory: OptimizerMemory | None = None


class StepMonitor(MonitorCore):
    """A monitor hooked to one optimizer's steps (``attach``, ``bind``): every ``every``-th step's update is
    attacked, the step's own gradient where the server undoes the optimizer, DP-SGD's under Opacus."""

    _pending: _Pending | None

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer whose steps are hooked (the one Opacus's DPOptimizer wraps), once attached."""
        if self._inner is None:
            raise RunError("LeakMonitor: attach the monitor to an optimizer first")
        return self._inner

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any) -> tuple[nn.Module, Any, Any]:
        """Hook ``optimizer``'s steps and ``loader``'s batches; returns ``(model, optimizer, loader)`` to train
        with as before. Raises ConfigError, one line per problem, before any training step."""
        self.bind(model, optimizer, getattr(loader, "dataset", None), loader)
        return model, optimizer, MonitoredLoader(loader, self)

    def bind(self, model: nn.Module, optimizer: torch.optim.Optimizer, dataset: Any, loader: Any = None) -> None:
        """``attach`` for loops that hand the monitor each batch themselves (``observe_batch``): Lightning."""
        self.detach()
        self._physical: list[Any] = []
        self._inner = getattr(optimizer, "original_optimizer", optimizer)  # Opacus's DPOptimizer wraps one
        self._accountant = opacus_accountant(optimizer)
        self._dp = self._dp_settings(optimizer, loader)
        why = unsupported(self._inner)
        self._undo = self.attacker["memory"] and why is None
        problems = self._unoptimised(model)
        defense = self._defense_entry(problems)
        self._setup(model, dataset, loader, defense, FEDSGD, self._batch_size(optimizer, loader), problems,
                    f"every {self.every}-th step")
        self._handles = [self._inner.register_step_pre_hook(self._before_step),
                         self._inner.register_step_post_hook(self._after_step)]
        self._described["undone"] = None if not self.attacker["memory"] else (
            f"the server undoes {type(self._inner).__name__}'s update from the updates before it" if why is None
            else f"{why}: the server attacks the raw update")
        if self.attacker["memory"] and why is not None:
            warnings.warn(f"LeakMonitor: attacker memory: {why}; the raw update is attacked", stacklevel=3)
        self.folder.write_json(MONITOR, self._described)

    def observe_batch(self, batch: Any) -> None:
        """A batch the next optimizer step trains on; under Opacus's ``BatchMemoryManager`` the physical batches
        of one logical step, which together are its batch."""
        super().observe_batch(batch)
        if self._handles:  # hooked to an optimizer: its next step takes these batches
            self._physical.append(batch)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step = self.steps_taken
        if step % self.every or step in self._described["steps"]:
            return
        batch = self._step_batch(step)
        if batch is None:
            return
        plain = getattr(self.model, "_module", self.model)  # under an Opacus GradSampleModule: its module
        memory = remember(self.inner, trainable(plain)) if self._undo else None
        before, buffers = model_state(plain)
        self._pending = _Pending(step, before, buffers, batch, memory)

    def _step_batch(self, step: int) -> Any | None:
        """The batch step ``step`` trained on: the physical batches since the last step together under Opacus
        (virtual steps), the one batch otherwise; None, with the reason recorded, when it cannot be told."""
        batches = self._physical
        if not batches:
            self.skip(step, "no batch was seen since the last step: train on the loader attach returned (under "
                            "Opacus's BatchMemoryManager, on monitor.watch(memory_safe_loader))")
            return None
        if len(batches) == 1:
            return batches[0]
        if self._dp is None:
            self.skip(step, f"the optimizer stepped once over {len(batches)} batches (gradient accumulation); "
                            "the attacks take one batch's update")
            return None
        return joined([inputs_labels(b) for b in batches])

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps_taken += 1
        self._physical = []
        pending: _Pending | None = self._pending
        self._pending = None
        if pending is not None:
            self.audit_safely(pending.step, lambda: self._audit(pending))

    def _audit(self, pending: _Pending) -> None:
        """Attack one step's update: the step's own gradient where the server undoes the optimizer (memory), else
        ``(theta_before - theta_after) / lr`` with each parameter's own lr."""
        params = trainable(getattr(self.model, "_module", self.model))
        if pending.memory is not None:
            update = recover(pending.memory, pending.before, [p.detach() for p in params])
        else:
            lrs = [float(g["lr"]) for g in param_groups(self.inner, params)]
            update = [(b - a.detach()) / lr for b, a, lr in zip(pending.before, params, lrs)]
        self._attack_at(pending.step, pending.before, pending.buffers, update, pending.batch, FEDSGD)

    def _dp_settings(self, optimizer: Any, loader: Any) -> dict[str, Any] | None:
        """Opacus's noise multiplier, clipping norm, expected batch size and sampling rate, or None without it."""
        from opacus.optimizers import DPOptimizer

        if not isinstance(optimizer, DPOptimizer):
            return None
        dataset = getattr(loader, "dataset", None)
        rate = getattr(loader, "sample_rate", None)
        if rate is None and dataset is not None and hasattr(dataset, "__len__"):
            rate = optimizer.expected_batch_size / len(dataset)
        return {"noise_multiplier": float(optimizer.noise_multiplier), "max_grad_norm": float(optimizer.max_grad_norm),
                "expected_batch_size": int(optimizer.expected_batch_size), "sample_rate": rate,
                "accountant": None if self._accountant is None else self._accountant.mechanism()}

    def _defense_entry(self, problems: list[str]) -> str | dict[str, Any]:
        """The defense as an audit entry: the user's, or ``dpsgd`` with Opacus's settings under a DPOptimizer."""
        if self._dp is None:
            return self.defense
        registry = load_registry(self.plugins_dirs)
        kinds = {n: registry.get("defense", n) for n in registry.names("defense")}
        mirror = next(n for n, cls in kinds.items() if cls.mirrors_dp_optimizer)
        named = self.defense.get("name") if isinstance(self.defense, dict) else self.defense
        if named not in kinds or not (kinds[named].baseline or kinds[named].mirrors_dp_optimizer):
            problems.append(f"defense: {named!r}: the optimizer is Opacus's DPOptimizer, whose update is already "
                            f"DP-SGD's; leave defense out (or name {mirror})")
        return {"name": mirror, "params": {k: self._dp[k] for k in ("noise_multiplier", "max_grad_norm")}}

    def _unoptimised(self, model: nn.Module) -> list[str]:
        """Trainable parameters the optimizer does not step (their update cannot be read off the weights)."""
        stepped = {id(p) for g in self.inner.param_groups for p in g["params"]}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in stepped]
        zero = [i for i, g in enumerate(self.inner.param_groups) if not g.get("lr")]
        return ([f"optimizer: does not step {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; give it "
                 "every trainable parameter of the model"] if missing else []) + (
            [f"optimizer: param_groups {zero} have lr 0; the update is read as (before - after) / lr"] if zero else [])

    @staticmethod
    def _batch_size(optimizer: Any, loader: Any) -> int:
        return int(getattr(optimizer, "expected_batch_size", None) or getattr(loader, "batch_size", None) or 1)


def opacus_accountant(optimizer: Any) -> Any | None:
    """The accountant Opacus's ``PrivacyEngine`` attached to its ``DPOptimizer`` (its step hook is the
    accountant's), so that epsilon is the figure ``privacy_engine.get_epsilon`` prints; None without one."""
    hook = getattr(optimizer, "step_hook", None)
    if hook is None:
        return None
    from opacus.accountants import IAccountant

    found = inspect.getclosurevars(hook).nonlocals.get("self")
    return found if isinstance(found, IAccountant) else None
