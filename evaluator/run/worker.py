"""One audit's jobs as a process runs them: train under a setting, share and attack a cell, score each row.

``AuditWorker`` holds everything one audit's jobs share (its scenario, the loaded checkpoints, each
setting's epsilon); one is made per audit, in the main process or in each worker process, so
nothing is carried over from one audit to the next.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from leakaudit.evaluator.audit.jobs import Cell
from leakaudit.evaluator.audit.types import Audit
from leakaudit.evaluator.results.rows import Row
from leakaudit.evaluator.results.rundir import AttackFailed, RunFolder
from leakaudit.evaluator.results.verdict import identification_bound
from leakaudit.evaluator.run.scenario import Scenario, loss_fn, round_generators
from leakaudit.evaluator.run.step import Judging, Read, Update, judge_updates, read_update
from leakaudit.evaluator.run.utility import privacy_spent, train_under_defense
from leakaudit.evaluator.zoo.metrics import score
from leakaudit.plugins.attack import Problem, Reconstruction, solve
from leakaudit.plugins.protocol import ClientStep
from leakaudit.plugins.spec import one_line


class AuditWorker:
    """One audit's jobs: training, tuning trials and attacks, with the caches they share."""

    def __init__(self, scenario: Scenario, folder: RunFolder):
        self.scenario = scenario
        self.folder = folder
        self._states: dict[str, dict[int, dict]] = {}
        self._epsilon: dict[str, float | None] = {}
        self._bound: dict[str, float | None] = {}
        self._profile: dict[str, Any] = {}

    def train(self, setting) -> dict[str, Any]:
        """Train under one defense setting; save its checkpoints; return its utility row."""
        result = train_under_defense(self.scenario, setting)
        self.folder.save_checkpoints(setting, result.pop("states"))
        return result

    def _states_of(self, setting) -> dict[int, dict]:
        if setting.key not in self._states:
            self._states = {setting.key: torch.load(self.folder.checkpoint_file(setting), map_location="cpu",
                                                    weights_only=True)}  # one setting at a time: bounded memory
        return self._states[setting.key]

    def provide_states(self, setting_key: str, fetch: Callable[[], dict[int, dict]]) -> None:
        """Hold a setting's checkpoints fetched from elsewhere than the run folder (a Ray task: from the object
        store); ``fetch`` is called only when this worker does not hold them already."""
        if setting_key not in self._states:
            self._states = {setting_key: fetch()}

    def epsilon(self, setting) -> float | None:
        """The setting's epsilon after utility training."""
        if setting.key not in self._epsilon:
            self._epsilon[setting.key] = privacy_spent(self.scenario, self.scenario.defense(setting))
        return self._epsilon[setting.key]

    def profile(self, setting):
        """The setting's privacy guarantee for one update (None without one)."""
        if setting.key not in self._profile:
            self._profile[setting.key] = self.scenario.defense(setting).privacy_profile()
        return self._profile[setting.key]

    def bound(self, setting) -> float | None:
        """The most any attack can identify of the audit's targets (a guess names an update's images: batch size
        in the number of targets) under the setting's privacy guarantee for one update; None where it gives none."""
        if setting.key not in self._bound:
            audit = self.scenario.audit
            self._bound[setting.key] = identification_bound(self.profile(setting), audit.batch_size_of(setting),
                                                            audit.data.targets)
        return self._bound[setting.key]

    def problems(self, setting, checkpoint: int, batches: list[tuple], purpose: str) -> list[Read]:
        """The defended update of each ``(pixels, labels, index, attack)`` batch at one checkpoint, as problems
        read as the attacker reads them (``read_update``), with the images each update was computed on (the pixels,
        or their augmentations under ATS; the first client's alone where its own coordinates are read): the
        originals a reconstruction is scored against.

        The model is built and loaded once, so the problems share it (and vectorised attacks solve them
        together). ``purpose`` ("" for targets, "tune-" for tuning batches) and ``index`` seed the defense's
        noise and the attack's start (``round_generators``: the same for every attack and every trial).
        """
        sc = self.scenario
        defense = sc.defense(setting)
        model = sc.fresh_model(defense, setting)
        model.load_state_dict(self._states_of(setting)[checkpoint])
        model.train(sc.model_section(setting).mode == "train")
        shared: dict[int, tuple] = {}
        out = []
        # a frontier's fresh targets draw their own noise and starts: batch indices counted on from the searched ones
        first = 0 if purpose else sc.audit.target_offset // sc.batch_size(setting)
        for pixels, labels, index, attack in batches:
            share_gen, attack_gen = round_generators(sc.device, sc.audit.seed, setting.identity, checkpoint,
                                                     first + index, purpose)
            if index not in shared:  # every trial of a search attacks the same update of a batch
                pixels = defense.augment(pixels, share_gen)
                step = ClientStep(model, loss_fn, sc.normalise(pixels), labels, share_gen, sc.protocol(setting))
                shared[index] = (defense.share(step), sc.threat(model, defense, labels, setting), pixels)
            update, threat, pixels = shared[index]
            out.append(read_update(Problem(update, threat, attack_gen, attack), pixels, labels))
        return out

    def tune(self, cell: Cell) -> list[dict[str, Any]]:
        """Every trial of one search, each on the tuning batches, solved together; a row per trial."""
        sc, first = self.scenario, cell.first
        spec = first.attack.tune
        metric = sc.audit.registry.get("metric", spec.metric)
        batches = [sc.tuning_batch(t, first.setting) for t in range(spec.targets)]
        attacks = [sc.attack(job.attack, job.params) for job in cell.jobs]
        read = self.problems(first.setting, first.checkpoint, [
            (*batches[t], t, attack) for attack in attacks for t in range(spec.targets)], "tune-")
        recs = _reconstruct(sc.audit, first, [r.problem for r in read], "tuning")
        rows = []
        for j, job in enumerate(cell.jobs):
            mine = slice(j * spec.targets, (j + 1) * spec.targets)
            values = [score([metric], rec.images, r.originals, rec.labels, r.labels).values[metric.name]
                      for rec, r in zip(recs[mine], read[mine])]
            known = [v for v in values if v is not None]
            assert len(known) == len(values), f"tuning's metric {metric.name} scores every reconstruction"
            rows.append({"setting": job.setting.key, "attack": job.attack.key, "checkpoint": job.checkpoint,
                         "trial": job.trial, "stage": job.stage, "params": job.params, "metric": metric.name,
                         "score": sum(known) / len(known), "seconds": round(sum(r.seconds for r in recs[mine]), 3)})
        return rows

    def attack(self, cell: Cell) -> list[Row]:
        """Share the defended update of each target batch of one cell, attack them together, judge each (the step);
        an attack that raises is an AttackFailed naming it, its origin and the job, on one line."""
        sc, first = self.scenario, cell.first
        audit = sc.audit
        attack = sc.attack(first.attack, first.params)
        batches = [sc.target_batch(job.target, first.setting) for job in cell.jobs]
        read = self.problems(first.setting, first.checkpoint,
                             [(px, lb, job.target, attack) for (px, lb), job in zip(batches, cell.jobs)], "")
        updates = [Update(job, r.problem, r.originals, r.labels,
                          sc.target_ids(job.target, job.setting).tolist()[:len(r.originals)], r.own_coordinates)
                   for job, r in zip(cell.jobs, read)]
        profile = self.profile(first.setting)
        judging = Judging([audit.registry.get("metric", m) for m in audit.metrics], sc.modality,
                          self.epsilon(first.setting), self.bound(first.setting),
                          None if profile is None else profile.mu, audit.verdict.confidence,
                          lambda aligned, update: sc.pii_recall(aligned, update.images), self.folder.save_reconstruction)
        what = f"{len(cell.jobs)} target batch(es)"
        return [j.row for j in judge_updates([updates], judging, audit.max_problems,
                                             fail_as=lambda update, exc: _failed(audit, update.job, what, exc))]


def _reconstruct(audit: Audit, job, problems: list[Problem], what: str) -> list[Reconstruction]:
    """The attack's reconstructions of ``problems``; an attack that raises is an AttackFailed (``_failed``)."""
    try:
        return solve(problems, audit.max_problems)
    except Exception as exc:
        raise _failed(audit, job, what, exc) from None


def _failed(audit: Audit, job, what: str, exc: Exception) -> AttackFailed:
    """An attack's failure on ``job``, naming the attack, its origin and the job, on one line."""
    origin = audit.registry.entries["attack"][job.attack.name].origin
    return AttackFailed(f"attack {job.attack.key!r} ({origin}) failed on {job.setting.key}, step {job.checkpoint} "
                        f"({what}): {one_line(exc)}; the rows already written are kept: fix it and rerun with --resume")
