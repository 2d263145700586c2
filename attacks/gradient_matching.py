"""Gradient-matching attacks: optimise images whose update matches the observed one.

``inverting_gradients`` (Geiping et al. 2020): cosine distance, priors, signed Adam.
``dlg`` (Zhu et al. 2019): Euclidean distance, L-BFGS on the image and a soft label.
``idlg`` (Zhao et al. 2020): the label read from the gradient, then ``dlg`` on the image.
"""
from __future__ import annotations

import bisect
import functools
import math
from typing import Any, Callable, ClassVar, cast

import torch
from torch import Tensor, nn
from torch.func import grad_and_value, vmap
from typing_extensions import Self

from leakaudit.attacks import vectorised
from leakaudit.attacks.lbfgs import BatchedLBFGS, Evaluate, LBFGSSettings, LockStep, Solver, minimise
from leakaudit.attacks.batchnorm_prior import SOURCES, batch_statistics, statistics_distance, target_statistics
from leakaudit.attacks.labels import METHODS, recover_labels
from leakaudit.attacks.priors import PRIORS, check_priors, prior_penalty
from leakaudit.attacks.vectorised import (
    Batch,
    SharedModel,
    batched,
    candidate_update,
    optimise,
    prior_sum,
    problem_hyper,
    rows_of,
    solve_all,
    refuse_one_path_overrides,
    Plain,
    split_metadata,
    stack_targets,
    stacked_state,
    vectorisable,
)
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.attack import (
    HONEST_SERVER,
    MAX_ITERATIONS,
    SERVER_READING_STATISTICS,
    Attack,
    Problem,
    Reconstruction,
    ThreatModel,
)
from leakaudit.plugins.defense import Defense, SharedUpdate, cosine_distance, squared_distance
from leakaudit.plugins.protocol import Protocol, buffers_kept, tracking_batchnorms


def step_decay_milestones(iterations: int) -> list[int]:
    """Learning-rate drops at 3/8, 5/8 and 7/8 of the run, as in Geiping et al. 2020."""
    return [iterations * k // 8 for k in (3, 5, 7)]


def random_images(threat: ThreatModel, generator: torch.Generator) -> Tensor:
    """A standard-normal start in normalised space, as in Geiping et al. 2020."""
    shape = (threat.batch_size, *threat.input_shape)
    return torch.randn(shape, generator=generator, device=threat.device)


def kept(tensors: list[Tensor], keep: list[bool] | None) -> list[Tensor]:
    """The tensors an attack matches: all, or those ``keep`` marks."""
    return tensors if keep is None else [t for t, k in zip(tensors, keep) if k]


def matched_tensors(observed: SharedUpdate, threat: ThreatModel) -> list[bool]:
    """Per shared tensor, whether an informed attacker matches it (not rewritten by the defense)."""
    dropped = threat.defense.defended_tensors(observed.names)
    return [n not in dropped for n in observed.names]


LABEL_METHOD = Param("auto", str, choices=METHODS, help="label recovery when labels are not known")
BN_WEIGHT = Param(1e-2, float, min=0.0, help="weight of the BatchNorm-statistics prior (R_BN of Yin et al. 2021) "
                                              "beside the cosine distance")
PRIOR_WEIGHTS = f"weights of image priors by name ({', '.join(PRIORS)})"


class InvertingGradients(Attack):
    """Cosine gradient matching with total variation, signed Adam and a box constraint (Geiping et al.)."""
    attacker = HONEST_SERVER

    name = "inverting_gradients"
    paper = "Geiping et al. 2020"
    auto_params = {"cpu": {"iterations": 1000}, "cuda": {"iterations": 4800}}
    params = {
        "iterations": Param(4800, int, min=1, max=MAX_ITERATIONS, help="optimisation steps per restart",
                            budget=True),
        "lr": Param(0.1, float, min=0.0, exclusive_min=True, help="Adam step size"),
        "priors": Param({"tv": 1e-2}, dict, help=PRIOR_WEIGHTS),
        "restarts": Param(1, int, min=1, help="random restarts; the best gradient match is kept"),
        "signed": Param(True, bool, help="use the sign of the image gradient (adversarial-attack style)"),
        "label_method": LABEL_METHOD,
        "drop_defended": Param(False, bool, help="leave out of the match the tensors the defense declares "
                                                 "rewritten (Soteria's layer: the attack of Balunovic et al. 2022, Sec. 5)"),
        "bn_prior": Param("none", str, choices=SOURCES[:2],
                          help="BatchNorm-statistics prior: none, or the model's running statistics (Yin et al. 2021); "
                               "the batch's own, read off the sent buffers, is inverting_gradients_bn's"),
        "bn_weight": BN_WEIGHT,
    }
    iterations: int
    lr: float
    priors: dict[str, Any]
    restarts: int
    signed: bool
    label_method: str
    drop_defended: bool
    bn_prior: str
    bn_weight: float

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        check_priors(self.priors)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_one_path_overrides(cls, ("reconstruct", "_objective", "_one_run"))

    #: The settings that may differ between problems solved in one pass (each row's step size and prior weights);
    #: any other setting a subclass adds separates its problems (``like_problems``).
    per_problem: ClassVar[frozenset[str]] = frozenset({"lr", "priors"})

    @property
    def knows_defense(self) -> bool:
        return self.uses_defense or self.drop_defended

    def unsupported(self, model: nn.Module, batch_size: int, protocol: Protocol) -> str | None:
        if self.bn_prior == "none":
            return None
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if not norms or len(tracking_batchnorms(model)) != len(norms):
            return f"bn_prior: {self.bn_prior} needs a model whose every BatchNorm layer keeps running statistics"
        if self.bn_prior == "update" and not model.training:
            return "bn_prior: update reads the BatchNorm buffers a client's training moves; the model is in eval mode"
        return None

    def unsupported_defense(self, defense: Defense) -> str | None:
        if self.bn_prior == "update" and defense.shares_itself():
            return f"bn_prior: update: defense {defense.name!r} computes its update itself and sends no BatchNorm buffers"
        return None

    def _bn_targets(self, observed: SharedUpdate, threat: ThreatModel) -> list[Tensor]:
        """The statistics the BatchNorm prior holds candidates to (none without it), read before any forward pass."""
        return [] if self.bn_prior == "none" else target_statistics(self.bn_prior, threat.model, observed)

    def _bn_term(self, threat: ThreatModel, targets: list[Tensor]) -> Callable[[Tensor], Tensor | float]:
        """The weighted BatchNorm prior of one problem's candidates (0 without it), on a copy of the model that keeps
        its running statistics as they are."""
        if not targets:
            return lambda x: 0.0
        shared = SharedModel.of(threat.model)
        return lambda x: self.bn_weight * statistics_distance(
            batch_statistics(shared.module, shared.params, shared.buffers, x), targets)

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        with buffers_kept(threat.model):  # the candidates' forward passes in train mode leave the server's model be
            return self._reconstruct(observed, threat, generator)

    def _reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        bn = self._bn_term(threat, self._bn_targets(observed, threat))
        labels = recover_labels(observed, threat, self.label_method, generator)
        keep = matched_tensors(observed, threat) if self.drop_defended else None
        target = kept([t.to(threat.device) for t in observed.tensors], keep)
        best, best_extra, best_loss, traces = None, {}, float("inf"), []
        for _ in range(self.restarts):
            images, extra, trace = self._one_run(target, labels, threat, generator, keep, bn)
            with torch.no_grad():
                final = self._objective(images, labels, target, threat, keep, extra, bn).item()
            traces.append(trace)
            if final < best_loss:
                best, best_extra, best_loss = images, extra, final
        extras = {"match_loss": best_loss, **({"variables": best_extra} if best_extra else {})}
        assert best is not None  # restarts >= 1, and a first loss is below infinity or best stays the first
        return Reconstruction(threat.to_pixels(best.detach()), labels, traces[0], 0.0, extras)

    @classmethod
    def reconstruct_all(cls, problems: list[Problem[Self]], max_problems: int | None = None) -> list[Reconstruction]:
        """Problems with like settings (and their restarts) optimised together, ``max_problems`` at a time; both
        paths minimise ``objective``."""
        return solve_all(cls, problems, max_problems, per_problem=cls.per_problem, can_vectorise=cls._can_vectorise,
                         build=cls._batch, rows=lambda p: p.attack.restarts)

    @classmethod
    def _can_vectorise(cls, threat: ThreatModel) -> bool:
        return vectorisable(threat)

    @classmethod
    def _batch(cls, problems: list[Problem[Self]]) -> tuple[Batch, Callable[[Batch], list[Reconstruction]]]:
        first, threat = problems[0].attack, problems[0].threat
        keep = matched_tensors(problems[0].observed, threat) if first.drop_defended else None
        bn_targets = [p.attack._bn_targets(p.observed, p.threat) for p in problems]  # before any forward pass
        labels, starts, unknowns = [], [], []
        for p in problems:  # each problem's draws in the order it makes them alone: labels, then per restart
            labels.append(recover_labels(p.observed, p.threat, p.attack.label_method, p.generator))
            for _ in range(first.restarts):  # the start, then the unknowns drawn beside it
                starts.append(random_images(p.threat, p.generator))
                unknowns.append({n: [v.detach() for v in vs]
                                 for n, vs in p.attack._extra_variables(p.threat, p.generator).items()})
        owners = [i for i in range(len(problems)) for _ in range(first.restarts)]
        updates = [problems[i].observed for i in owners]
        stacked, static = split_metadata(updates) or ({}, {})  # the cosine match reads no metadata
        hyper = {**problem_hyper([problems[i].attack for i in owners], threat.device),
                 "state": stacked_state([problems[i].threat.model for i in owners]),
                 "bn_target": [torch.stack([bn_targets[i][k].to(threat.device) for i in owners])
                               for k in range(len(bn_targets[0]))]}
        batch = Batch(problems, torch.stack(starts), torch.stack([labels[i] for i in owners]),
                      kept(stack_targets(updates, threat.device), keep), stacked, static, hyper, owners,
                      {n: [torch.stack([u[n][i] for u in unknowns]) for i in range(len(vs))]
                       for n, vs in unknowns[0].items()})
        return batch, lambda b: cls._solve(b, keep, labels)

    @classmethod
    def _solve(cls, batch: Batch, keep: list[bool] | None, labels: list[Tensor]) -> list[Reconstruction]:
        first, threat = batch.problems[0].attack, batch.problems[0].threat
        shared = SharedModel.of(threat.model, threat)
        lo, hi = threat.box()

        def bn(x: Tensor, hyper: dict[str, Any]) -> Tensor | float:
            if not hyper["bn_target"]:
                return 0.0
            state = hyper["state"]
            params, buffers = (state["params"], state["buffers"]) if state else (shared.params, shared.buffers)
            return first.bn_weight * statistics_distance(batch_statistics(shared.module, params, buffers, x),
                                                         hyper["bn_target"])

        def objective(images, labels, target, metadata, hyper, unknowns):
            return first.objective(images, labels, target, unknowns, keep, shared.module,
                                   lambda x, y: candidate_update(shared, threat, x, y, hyper["state"]),
                                   lambda x: prior_sum(x, hyper, lo, hi) + bn(x, hyper))

        milestones = step_decay_milestones(first.iterations)
        images, unknowns, trace = optimise(batch, objective, iterations=first.iterations, signed=first.signed,
                                           box=(lo, hi), lr_factor=lambda it: 0.1 ** bisect.bisect_right(milestones, it))
        with torch.no_grad():
            final = batched(objective, with_grad=False)((images, unknowns), batch.labels, batch.targets,
                                                       batch.metadata, batch.hyper)
        out = []
        for i, p in enumerate(batch.problems):
            rows = [r for r, o in enumerate(batch.owners) if o == i]
            best = min(rows, key=lambda r: float(final[r]))
            extras: dict[str, Any] = {"match_loss": float(final[best])}
            if unknowns:
                extras["variables"] = {n: [v[best] for v in vs] for n, vs in unknowns.items()}
            out.append(Reconstruction(p.threat.to_pixels(images[best].detach()), labels[i], trace[:, rows[0]].tolist(),
                                      0.0, extras))
        return out

    def objective(self, images: Tensor, labels: Tensor, target: list[Tensor], unknowns: dict[str, list[Tensor]],
                  keep: list[bool] | None, model: nn.Module, plain: Plain,
                  prior: Callable[[Tensor], Tensor | float]) -> Tensor:
        """The loss both paths minimise: the cosine distance of ``plain``'s candidate update (the tensors ``keep``
        marks) to ``target``, plus ``prior`` of the images. ``unknowns`` are optimised beside the images, in
        ``model``, the module ``plain`` runs (one problem's; vmapped on the batched path)."""
        return cosine_distance(target, kept(plain(images, labels), keep)) + prior(images)

    def _objective(self, images: Tensor, labels: Tensor, target: list[Tensor], threat: ThreatModel,
                   keep: list[bool] | None, extra: dict[str, list[Tensor]],
                   bn: Callable[[Tensor], Tensor | float]) -> Tensor:
        """``objective`` of one problem by plain autograd; ``extra`` holds the unknowns optimised beside the images,
        ``bn`` is the problem's BatchNorm prior (``_bn_term``)."""
        lo, hi = threat.box()
        with torch.enable_grad():
            return self.objective(images, labels, target, extra, keep, threat.model, threat.candidate_update,
                                  lambda x: prior_penalty(x, self.priors, lo, hi) + bn(x))

    def _extra_variables(self, threat: ThreatModel, generator: torch.Generator) -> dict[str, list[Tensor]]:
        """Unknowns optimised beside the images (none here; drawn after the start image, so starts stay paired)."""
        return {}

    def _one_run(self, target, labels, threat, generator, keep, bn) -> tuple[Tensor, dict[str, list[Tensor]], list[float]]:
        lo, hi = threat.box()
        images = random_images(threat, generator).requires_grad_(True)
        extra = self._extra_variables(threat, generator)
        variables = [images, *(v for vs in extra.values() for v in vs)]
        optimiser = torch.optim.Adam(variables, lr=self.lr, foreach=True)  # as on a GPU: a few kernels per step
        schedule = torch.optim.lr_scheduler.MultiStepLR(optimiser, step_decay_milestones(self.iterations), 0.1)
        trace = torch.empty(self.iterations, device=threat.device)
        for it in range(self.iterations):
            loss = self._objective(images, labels, target, threat, keep, extra, bn)
            for v, grad in zip(variables, torch.autograd.grad(loss, variables)):
                v.grad = grad.sign() if self.signed else grad
            optimiser.step()
            schedule.step()
            with torch.no_grad():
                images.clamp_(lo, hi)
            trace[it] = loss.detach()
        return images, extra, trace.tolist()


#: Curvature pairs each L-BFGS run keeps (torch.optim.LBFGS's ``history_size``).
HISTORY = 100
#: At most this many problems share one ``BatchedLBFGS`` (their histories are one tensor).
MAX_BATCHED_PROBLEMS = 1024


def history_cap(problems: list[Problem], max_problems: int | None) -> int:
    """How many problems one ``BatchedLBFGS`` may hold: ``MAX_BATCHED_PROBLEMS``, and under ``max_problems: auto``
    no more than whose curvature histories (2 x ``HISTORY`` pairs of (s, y), each the size of the variables) fit in
    half of the ``MEMORY_SHARE`` of the device's free memory that ``chunk_size`` gives the passes themselves."""
    if max_problems is not None or not problems:
        return MAX_BATCHED_PROBLEMS

    def variables(t: ThreatModel) -> int:  # the images, and the soft labels where they are unknown
        return t.batch_size * (math.prod(t.input_shape) + (t.num_classes if t.labels is None else 0))

    threat = max((p.threat for p in problems), key=variables)
    element = torch.empty((), dtype=torch.get_default_dtype()).element_size()
    history = 2 * HISTORY * 2 * variables(threat) * element
    fits = int(vectorised.MEMORY_SHARE / 2 * vectorised.free_memory(threat.device) // history)
    return max(1, min(MAX_BATCHED_PROBLEMS, fits))


class InvertingGradientsBN(InvertingGradients):
    """Inverting Gradients with the batch's own BatchNorm statistics as a prior, read off the buffers the client
    sends with its weights (Hatamizadeh et al. 2023; the R_BN term of Yin et al. 2021)."""
    attacker = SERVER_READING_STATISTICS

    name = "inverting_gradients_bn"
    paper = "Hatamizadeh et al. 2023"
    #: Run by ``attacks: auto`` wherever the update carries BatchNorm statistics that training moved (``unsupported``):
    #: it is the attack of the server that reads them, whose verdict an audit then gives beside the honest server's,
    #: and it gained 0.8 dB over inverting_gradients at 300 iterations (docs/results.md).
    auto_params = InvertingGradients.auto_params
    params = {**InvertingGradients.params,
              "bn_prior": Param("update", str, choices=SOURCES,
                                help="BatchNorm-statistics prior: the batch's own, read off the sent buffers (update), "
                                     "the model's running statistics (model), or none"),
              "bn_weight": Param(1e-1, float, min=0.0, help=BN_WEIGHT.help)}


class DeepLeakage(Attack):
    """Euclidean gradient matching by L-BFGS on the image and a soft label jointly, with restarts (Zhu et al.)."""
    attacker = HONEST_SERVER

    name = "dlg"
    paper = "Zhu et al. 2019"
    auto_skip = "inverting_gradients matches gradients more strongly (Geiping et al. 2020) and runs in its place"
    params = {
        "iterations": Param(300, int, min=1, max=MAX_ITERATIONS, help="L-BFGS steps per restart", budget=True),
        "lr": Param(1.0, float, min=0.0, exclusive_min=True, help="L-BFGS step size"),
        "restarts": Param(4, int, min=1, help="random restarts; the best gradient match is kept"),
        "line_search": Param(True, bool, help="strong-Wolfe line search (off: fixed steps, as the DLG code)"),
        "priors": Param({}, dict, help=PRIOR_WEIGHTS),
    }
    iterations: int
    lr: float
    restarts: int
    line_search: bool
    priors: dict[str, Any]

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        check_priors(self.priors)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_one_path_overrides(cls, ("reconstruct", "_restarts", "_one_run"))

    #: The settings that may differ between problems solved together (each keeps its own L-BFGS run, and its
    #: prior weights); any other setting a subclass adds separates its problems (``like_problems``).
    per_problem: ClassVar[frozenset[str]] = frozenset({"iterations", "lr", "restarts", "line_search", "priors"})

    def _labels(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Tensor | None:
        """Fixed labels, or None when they are optimised jointly as soft labels."""
        return threat.labels.to(threat.device) if threat.labels is not None else None

    def reconstruct(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Reconstruction:
        fixed = self._labels(observed, threat, generator)
        target = [t.to(threat.device) for t in observed.tensors]
        lo, hi = threat.box()

        def evaluate(variables: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
            with torch.enable_grad():
                loss = self.objective(variables, fixed, target, threat.candidate_update,
                                      lambda x: prior_penalty(x, self.priors, lo, hi))
                return loss.detach(), list(torch.autograd.grad(loss, variables))

        return self._restarts(threat, generator, fixed, evaluate)

    def objective(self, variables: list[Tensor], fixed: Tensor | None, target: list[Tensor], plain: Plain,
                  prior: Callable[[Tensor], Tensor | float]) -> Tensor:
        """The loss both paths minimise: the squared distance of ``plain``'s candidate update to ``target``, plus
        ``prior`` of the image; the labels are ``fixed``, or the softmax of the soft labels ``variables[1]``."""
        labels = fixed if fixed is not None else torch.softmax(variables[1], dim=-1)
        return squared_distance(target, plain(variables[0], labels)) + prior(variables[0])

    @classmethod
    def reconstruct_all(cls, problems: list[Problem[Self]], max_problems: int | None = None) -> list[Reconstruction]:
        """Like problems solved together: each keeps its own L-BFGS iterate and line search, and their evaluations
        and two-loop recursions run as batched passes (``BatchedLBFGS``, benchmarks/lbfgs_batching.py); both paths
        minimise ``objective``."""
        return solve_all(cls, problems, max_problems, per_problem=cls.per_problem, can_vectorise=vectorisable,
                         build=cls._batch, cap=history_cap(problems, max_problems))

    @classmethod
    def _batch(cls, problems: list[Problem[Self]], lock_step: bool = False
               ) -> tuple[list[Problem[Self]], Callable[[list[Problem[Self]]], list[Reconstruction]]]:
        """The problems and their solver: ``BatchedLBFGS``, or with ``lock_step`` torch.optim.LBFGS per problem
        (``LockStep``, the reference the tests compare with)."""
        threat = problems[0].threat
        fixed = [p.attack._labels(p.observed, p.threat, p.generator) for p in problems]  # drawn first, as alone
        targets = stack_targets([p.observed for p in problems], threat.device)
        hyper = {**problem_hyper([p.attack for p in problems], threat.device),
                 "state": stacked_state([p.threat.model for p in problems])}
        labels = None if fixed[0] is None else torch.stack(cast(list[Tensor], fixed))
        shared, (lo, hi), first = SharedModel.of(threat.model, threat), threat.box(), problems[0].attack

        def loss(variables, target, hyper, label):
            return first.objective(variables, label, target,
                                   lambda x, y: candidate_update(shared, threat, x, y, hyper["state"]),
                                   lambda x: prior_sum(x, hyper, lo, hi))

        step = vmap(grad_and_value(loss), in_dims=(0, 0, 0, None if labels is None else 0))

        def evaluate(rows: list[int], variables: list[Tensor]) -> tuple[list[Tensor], Tensor]:
            pick = rows_of(rows, len(problems), threat.device)
            return step(variables, pick(targets), pick(hyper), None if labels is None else pick(labels))

        if lock_step:
            def evaluate_each(rows: list[int], variables: list[list[Tensor]]) -> list[tuple[Tensor, list[Tensor]]]:
                grads, losses = evaluate(rows, [torch.stack(v) for v in zip(*variables)])
                return [(losses[r], [g[r] for g in grads]) for r in range(len(rows))]

            def in_lock_step(part: list[Problem[Self]]) -> list[Reconstruction]:
                return LockStep(evaluate_each).run([
                    functools.partial(p.attack._restarts, p.threat, p.generator, f) for p, f in zip(part, fixed)])

            return problems, in_lock_step

        shapes = [(threat.batch_size, *threat.input_shape)] + ([] if labels is not None else
                                                                 [(threat.batch_size, threat.num_classes)])
        sizes = [math.prod(shape) for shape in shapes]

        def evaluate_flat(rows: list[int], x: Tensor) -> tuple[Tensor, Tensor]:
            parts = [v.reshape(len(rows), *shape) for v, shape in zip(x.split(sizes, dim=1), shapes)]
            grads, losses = evaluate(rows, parts)
            return losses, torch.cat([g.reshape(len(rows), -1) for g in grads], dim=1)

        def solve(part: list[Problem[Self]]) -> list[Reconstruction]:
            engine = BatchedLBFGS(evaluate_flat, len(part), sum(sizes), HISTORY, threat.device)
            return engine.run([p.attack._solver(p.threat, p.generator, f) for p, f in zip(part, fixed)])

        return problems, solve

    def _restarts(self, threat: ThreatModel, generator: torch.Generator, fixed: Tensor | None,
                  evaluate: Callable[[list[Tensor]], tuple[Tensor, list[Tensor]]]) -> Reconstruction:
        """The best of ``restarts`` L-BFGS runs; ``evaluate(variables)`` gives the loss and its gradients."""
        return self._best(threat, fixed, [self._one_run(threat, generator, fixed, evaluate)
                                          for _ in range(self.restarts)])

    def _solver(self, threat: ThreatModel, generator: torch.Generator, fixed: Tensor | None) -> Solver:
        """``_restarts`` as a solver for ``BatchedLBFGS``: the same starts, drawn in the same order, the same steps."""
        settings = LBFGSSettings(lr=self.lr, line_search=self.line_search, history_size=HISTORY)
        runs = []
        for _ in range(self.restarts):
            variables = self._start(threat, generator, fixed)
            x, trace = yield from minimise(torch.cat([v.reshape(-1) for v in variables]), self.iterations, settings)
            final = (yield Evaluate(x)).loss
            images, logits = x[:variables[0].numel()].view_as(variables[0]), x[variables[0].numel():]
            labels = fixed if fixed is not None else logits.view_as(variables[1]).argmax(dim=-1)
            runs.append((images, labels, final, trace))
        return self._best(threat, fixed, runs)

    @staticmethod
    def _best(threat: ThreatModel, fixed: Tensor | None, runs: list[tuple]) -> Reconstruction:
        """The run with the lowest final match (the first of equals; NaN from a diverged run counts as inf)."""
        runs = [(images, labels, loss if loss == loss else float("inf"), trace) for images, labels, loss, trace in runs]
        images, labels, loss, trace = min(runs, key=lambda run: run[2])
        return Reconstruction(threat.to_pixels(images), labels, trace, 0.0, {"match_loss": loss})

    def _start(self, threat: ThreatModel, generator: torch.Generator, fixed: Tensor | None) -> list[Tensor]:
        """A run's start: a random image, and a random soft label where the labels are not fixed."""
        variables = [random_images(threat, generator)]
        if fixed is None:
            variables.append(torch.randn((threat.batch_size, threat.num_classes), generator=generator,
                                         device=threat.device))
        return variables

    def _one_run(self, threat, generator, fixed, evaluate):
        variables = [v.requires_grad_(True) for v in self._start(threat, generator, fixed)]
        optimiser = torch.optim.LBFGS(variables, lr=self.lr, max_iter=20, history_size=HISTORY,
                                      line_search_fn="strong_wolfe" if self.line_search else None)

        def closure() -> Tensor:
            loss, grads = evaluate(variables)
            for v, g in zip(variables, grads):
                v.grad = g
            return loss

        trace = []
        for _ in range(self.iterations):
            loss = optimiser.step(closure)
            trace.append(loss)
            if not torch.isfinite(loss) or loss.item() == 0.0:
                break
        final = evaluate(variables)[0].item()
        labels = fixed if fixed is not None else variables[1].detach().argmax(dim=-1)
        return variables[0].detach(), labels, final, torch.stack(trace).tolist()


class ImprovedDeepLeakage(DeepLeakage):
    """The label read from the gradient's signs, then Euclidean matching by L-BFGS on the image only (Zhao et al.)."""

    name = "idlg"
    paper = "Zhao et al. 2020"
    params = {**DeepLeakage.params, "label_method": LABEL_METHOD}
    label_method: str

    def _labels(self, observed: SharedUpdate, threat: ThreatModel, generator: torch.Generator) -> Tensor:
        return recover_labels(observed, threat, self.label_method, generator)


@hookimpl
def register_attacks():
    return [InvertingGradients, InvertingGradientsBN, DeepLeakage, ImprovedDeepLeakage]
