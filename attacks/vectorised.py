"""Many independent gradient-matching problems optimised together: one function of one problem, vmapped.

A problem is one target batch's observed update with its own generator, start and hyperparameters.
The matching loss of one problem is a pure function of its candidate images (the model's update
through ``torch.func``: ``functional_call`` and ``grad``), so ``vmap`` evaluates it for K problems in
one batched pass, as in PyTorch's per-sample-gradient and model-ensembling tutorials. Each problem's
forward computes its own batch statistics (BatchNorm in train mode never mixes problems), and each
problem keeps its own Adam state and step size. Draws from a problem's generator happen outside
``vmap``, in the same order as when the problem is solved alone, so the numbers do not depend on how
problems are grouped.
"""
from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence, cast

import torch
from torch import Tensor, nn
from torch.func import grad_and_value, vmap

from leakaudit.attacks.priors import PRIORS
from leakaudit.plugins.attack import Attack, Problem, Reconstruction, ThreatModel, parameter_gradient
from leakaudit.plugins.defense import Defense, SharedUpdate
from leakaudit.plugins.stochastic import noise_from, stochastic_modules

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
MEMORY_SHARE = 0.5  # of the free device memory that ``max_problems: auto`` lets one chunk use
#: On a CPU, ``auto`` solves problems together only for models up to this many trainable parameters: measured
#: faster for lenet_zhu (14k: 2.2x at K = 8, 5.4x at K = 64), cnn_bayes (0.25M: 1.15x) and resnet20 (0.27M:
#: 1.2x), slower for the 0.85M-parameter mlp (0.5x) and the 2.9M-parameter convnet (docs/results.md, Speed).
CPU_MAX_PARAMETERS = 300_000
#: Whether ``optimise``'s iterations go through torch.compile (an audit's ``compile: true``; set by ``compile_steps``).
_COMPILE = False
#: Whether compiled iterations are captured as CUDA graphs and replayed (torch.compile's "reduce-overhead" mode): set
#: by ``compile_steps`` for an audit that compiles on CUDA, where an eager iteration is bound by its kernel launches.
_CUDA_GRAPHS = False
#: The dtype ``optimise``'s model passes run in under autocast (an audit's ``precision: bfloat16``; None: as the
#: model is, float32): set by ``autocast_steps``.
_AUTOCAST: torch.dtype | None = None
#: Compilations torch keeps for one function before it runs it eagerly: every vectorised iteration is one function
#: to torch (``_iteration``'s), and each attack, model shape and chunk size is a compilation of it (torch's default: 8).
RECOMPILE_LIMIT = 256


def compile_steps(enabled: bool, cuda_graphs: bool = False) -> Callable[[], None]:
    """Compile every vectorised iteration from now on (or not), in this process, with ``cuda_graphs`` captured and
    replayed as CUDA graphs; returns what restores the setting.

    torch.compile caches what it builds by code and input shapes, so chunks of one model shape, attack and chunk
    size compile once per process, and its disk cache serves later runs. All steps share torch's per-function limit
    on compilations, raised to ``RECOMPILE_LIMIT`` while compiling is on; a step the compiler fails on runs eagerly."""
    global _COMPILE, _CUDA_GRAPHS
    before, _COMPILE, _CUDA_GRAPHS = (_COMPILE, _CUDA_GRAPHS), enabled, enabled and cuda_graphs
    if enabled:  # torch._dynamo is imported only where compiling is asked for (it costs most of a second)
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        limit, simdlen = dynamo_config.recompile_limit, inductor_config.cpp.simdlen
        suppress = dynamo_config.suppress_errors
        dynamo_config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        # a compiler failure runs that step eagerly, with torch's warning, instead of failing the attack: torch
        # 2.11's inductor failed an assertion fusing bayesian_kl's step on VB-ResNet-18 (CUDA), where eager is right
        dynamo_config.suppress_errors = True
        if torch.backends.cpu.get_cpu_capability() == "AVX2":
            # torch 2.14.1's inductor, vectorising an Inverting Gradients step for AVX2, returned NaN images where
            # eager and unvectorised compiled code agree to 1e-5 (LeNet at 16 px, 20 steps, ATEN_CPU_CAPABILITY=avx2
            # on an AVX-512 machine): there, compiled steps run unvectorised
            inductor_config.cpp.simdlen = 1

    def restore() -> None:
        global _COMPILE, _CUDA_GRAPHS
        _COMPILE, _CUDA_GRAPHS = before
        if enabled:
            dynamo_config.recompile_limit = limit
            dynamo_config.suppress_errors = suppress
            inductor_config.cpp.simdlen = simdlen
    return restore



def autocast_steps(precision: str) -> Callable[[], None]:
    """Run every vectorised iteration's forward and double backward under autocast to ``precision`` ("bfloat16"),
    or as the model is ("float32"), in this process; returns what restores the setting. The images, the unknowns
    and Adam's state stay float32, and chunks of one problem are vectorised too. Attacks outside ``optimise``
    (L-BFGS, TAG, CI-Net) and problems that cannot be vectorised run as the model is."""
    global _AUTOCAST
    dtypes = {"float32": None, "bfloat16": torch.bfloat16}
    if precision not in dtypes:
        raise ValueError(f"precision: {precision!r}; choices: {', '.join(dtypes)}")
    before, _AUTOCAST = _AUTOCAST, dtypes[precision]

    def restore() -> None:
        global _AUTOCAST
        _AUTOCAST = before
    return restore


def vectorisable(threat: ThreatModel) -> bool:
    """Whether the model's update is a pure function of its inputs that torch.func can transform: no noise
    drawn inside the model, and no module backward hooks (Opacus's per-sample hooks), which torch.func refuses."""
    hooked = any(m._backward_hooks or m._backward_pre_hooks for m in threat.model.modules())
    return not any(m.draws_noise for m in stochastic_modules(threat.model)) and not hooked


@dataclass
class SharedModel:
    """The attacked model as torch.func sees it: a copy whose BatchNorm layers use batch statistics only
    (in train mode, as the client computed its update), with its trainable parameters and other state."""

    module: nn.Module
    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    #: The gradient of the defense's parameter-only loss term, by parameter name, where it is hoisted out of every
    #: candidate's update (``parameter_gradient``); None where it stays inside.
    hoisted: dict[str, Tensor] | None = None

    @classmethod
    def of(cls, model: nn.Module, threat: ThreatModel | None = None) -> "SharedModel":
        """``model`` for torch.func; with ``threat`` (whose model it is), the defense's parameter-only term's gradient
        is computed here, once, for ``candidate_update`` to add."""
        hoisted = None if threat is None else parameter_gradient(model, threat.defense, threat.protocol)
        module = model
        if model.training and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            module = copy.deepcopy(model)
            torch.func.replace_all_batch_norm_modules_(module)  # running statistics off: no in-place update
        params = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
        frozen = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
        named = None if hoisted is None else dict(zip(params, hoisted))
        return cls(module, params, {**frozen, **dict(module.named_buffers())}, named)


def model_key(model: nn.Module) -> tuple:
    """Models with this key have the same architecture: their problems run in one vmapped pass, with each
    problem's parameters stacked (``stacked_state``) when the models are different objects."""
    return (repr(model), model.training, tuple((n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()))


def stacked_state(models: list[nn.Module]) -> dict[str, dict[str, Tensor]]:
    """Each row's trainable parameters and other state, stacked along a leading dimension; empty when every row
    uses the same model object (then the shared model's own state is used)."""
    if all(m is models[0] for m in models):
        return {}
    states = {id(m): SharedModel.of(m) for m in models}
    rows = [states[id(m)] for m in models]
    return {"params": {n: torch.stack([r.params[n] for r in rows]) for n in rows[0].params},
            "buffers": {n: torch.stack([r.buffers[n] for r in rows]) for n in rows[0].buffers}}


def candidate_update(shared: SharedModel, threat: ThreatModel, images: Tensor, labels: Tensor,
                     state: dict[str, dict[str, Tensor]] | None = None) -> list[Tensor]:
    """The clean update of candidate ``images`` under the threat's protocol and client loss, via torch.func;
    ``state`` holds this problem's own parameters and buffers where problems have different models."""
    params, buffers = (state["params"], state["buffers"]) if state else (shared.params, shared.buffers)
    hoisted = None if state else shared.hoisted  # each problem's own model: its term stays inside
    loss_fn = threat.defense.client_loss(shared.module, threat.loss_fn) if hoisted is None else threat.loss_fn
    grads = threat.protocol.functional_update(shared.module, params, buffers, loss_fn, images, labels)
    return [grads[n] if hoisted is None else grads[n] + hoisted[n] for n in shared.params]


def problem_hyper(attacks: list, device: torch.device) -> dict[str, Tensor]:
    """Each row's step size and prior weights as (K,) tensors: the hyperparameters that may differ between
    problems (tuning trials) and still run in one pass."""
    return {"lr": torch.tensor([a.lr for a in attacks], device=device),
            **{f"prior.{n}": torch.tensor([float(a.priors[n]) for a in attacks], device=device)
               for n in attacks[0].priors}}


def prior_sum(images: Tensor, hyper: dict[str, Tensor], low: Tensor, high: Tensor) -> Tensor:
    """The priors weighted by one problem's ``prior.<name>`` entries of ``hyper`` (0-d under vmap)."""
    total = images.new_zeros(())
    for key, w in hyper.items():
        if key.startswith("prior."):
            name = key.removeprefix("prior.")
            total = total + w * (PRIORS[name](images, low, high) if name == "range" else PRIORS[name](images))
    return total


@dataclass
class Batch:
    """K problems stacked along a leading dimension: what one vmapped pass takes."""

    problems: list[Problem]
    starts: Tensor                      # (K, B, C, H, W), normalised
    labels: Tensor                      # (K, B) class indices (or (K, B, classes) soft labels)
    targets: list[Tensor]               # each (K, ...)
    metadata: dict[str, Any]            # tensor metadata of the shared updates, stacked
    static_metadata: dict[str, Any]     # metadata equal across the problems
    hyper: dict[str, Any]               # per-problem hyperparameters, each (K,); the stacked state
    owners: list[int] = field(default_factory=list)  # which input problem each row belongs to (restarts)
    unknowns: dict[str, list[Tensor]] = field(default_factory=dict)  # optimised beside the images, each (K, ...)

    def observed(self, target: Sequence[Tensor], metadata: dict[str, Tensor], template: SharedUpdate) -> SharedUpdate:
        """One problem's shared update, rebuilt inside vmap from its batched pieces."""
        return SharedUpdate(list(target), template.names, template.batch_size,
                            {**self.static_metadata, **metadata})


def _stackable(values: list[Any]) -> bool:
    """Tensors of one shape, or equally long lists of such tensors (a mask per shared tensor)."""
    if all(isinstance(v, Tensor) for v in values):
        return len({tuple(v.shape) for v in values}) == 1
    return (all(isinstance(v, (list, tuple)) for v in values) and len({len(v) for v in values}) == 1
            and all(_stackable(list(parts)) for parts in zip(*values)))


def _stack(values: list[Any], device: torch.device) -> Any:
    if isinstance(values[0], Tensor):
        return torch.stack([v.to(device) for v in values])
    return [_stack(list(parts), device) for parts in zip(*values)]


def split_metadata(updates: list[SharedUpdate]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Tensor metadata (and lists of tensors) stacked across problems, the rest shared; None when the rest
    differs between problems (they are then solved one at a time)."""
    keys = set(updates[0].metadata)
    if any(set(u.metadata) != keys for u in updates):
        return None
    stacked, static = {}, {}
    for k in keys:
        values = [u.metadata[k] for u in updates]
        if _stackable(values):
            stacked[k] = _stack(values, updates[0].tensors[0].device)
        elif all(repr(v) == repr(values[0]) for v in values):
            static[k] = values[0]
        else:
            return None
    return stacked, static


def rows_of(rows: list[int], total: int, device: torch.device) -> Callable[[Any], Any]:
    """Selects ``rows`` of every tensor in a nest of dicts, lists and tensors stacked over ``total`` problems
    (all rows: the nest itself)."""
    if len(rows) == total:
        return lambda nest: nest
    index = torch.tensor(rows, device=device)

    def pick(nest: Any) -> Any:
        if isinstance(nest, Tensor):
            return nest.index_select(0, index)
        if isinstance(nest, dict):
            return {k: pick(v) for k, v in nest.items()}
        return [pick(v) for v in nest]

    return pick


def stack_targets(updates: list[SharedUpdate], device: torch.device) -> list[Tensor]:
    return [torch.stack([u.tensors[i].to(device) for u in updates]) for i in range(len(updates[0].tensors))]


def chunk_size(max_problems: int | None, threat: ThreatModel, per_problem_images: int, total: int) -> int:
    """How many problems run together: ``max_problems``, or (None: auto) what fits in free device memory;
    1 on a CPU for models above ``CPU_MAX_PARAMETERS``, where one at a time measured faster."""
    if max_problems is not None:
        return max(1, min(max_problems, total))
    params = sum(p.numel() for p in threat.model.parameters() if p.requires_grad)
    if threat.device.type != "cuda" and params > CPU_MAX_PARAMETERS:
        return 1
    footprint = problem_footprint(threat, per_problem_images)
    return max(1, min(total, int(MEMORY_SHARE * free_memory(threat.device) // footprint)))


def free_memory(device: torch.device) -> int:
    """Free bytes on ``device``: CUDA's own count, else the operating system's available memory (Linux's
    MemAvailable, which counts reclaimable caches; else the free pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def problem_footprint(threat: ThreatModel, images: int) -> int:
    """Bytes one problem needs per step: its activations kept for a double backward pass, and the update.

    Counted from one forward pass of one image (hooks on every module), times the images of a
    problem, with a factor for the graph of the gradient and of its gradient.
    """
    sizes: list[int] = []
    model = threat.model
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel() if isinstance(out, Tensor) else 0))
             for m in model.modules()]
    was_training = model.training
    devices = [threat.device] if threat.device.type == "cuda" else []
    try:  # eval mode and a forked RNG: counting leaves the model's statistics and every random stream as they were
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            model(torch.zeros((1, *threat.input_shape), device=threat.device))
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    params = sum(p.numel() for p in threat.model.parameters())
    element = 4 if threat.mean.dtype != torch.float64 else 8
    return element * (6 * sum(sizes) * images + 4 * params)


def batched(objective: Callable[..., Tensor], extra_dims: tuple = (), with_grad: bool = True) -> Callable:
    """``objective(images, labels, targets, metadata, hyper, unknowns, *extras)`` over K problems, or its
    gradient in ``(images, unknowns)`` and its value; ``extra_dims`` are the ``in_dims`` of the extras
    (0: one per problem, None: shared)."""
    def joint(variables, labels, targets, metadata, hyper, *extras):
        return objective(variables[0], labels, targets, metadata, hyper, variables[1], *extras)

    return vmap(grad_and_value(joint) if with_grad else joint, in_dims=(0, 0, 0, 0, 0, *extra_dims))


def optimise(batch: Batch, objective: Callable[..., Tensor], *, iterations: int,
             lr_factor: Callable[[int], Tensor | float],
             signed: bool, box: tuple[Tensor, Tensor],
             per_step: Callable[[int], tuple[tuple[Any, int | None], ...]] = lambda it: ()
             ) -> tuple[Tensor, dict[str, list[Tensor]], Tensor]:
    """Adam on K problems at once, each with its own step size ``hyper['lr']`` scaled by ``lr_factor(it)``.

    ``objective(images, labels, targets, metadata, hyper, unknowns, *extras)`` is the loss of one
    problem; ``batch.unknowns`` are optimised with the images (same step size and schedule), the
    images alone kept in the box. ``per_step(it)`` supplies the iteration's extra inputs as
    ``(value, in_dim)`` pairs (Monte Carlo draws, one per problem; a warm-up weight, shared). Returns
    the final images and unknowns, and the trace (iterations, K). The update is torch.optim.Adam's,
    so one problem alone follows Adam's path. One iteration (the gradient, Adam's step, the box) is one
    function: under ``compile: true`` it compiles whole, and on CUDA it is captured once and replayed.
    """
    names = [(n, i) for n, vs in batch.unknowns.items() for i in range(len(vs))]
    xs = [batch.starts.clone(), *(batch.unknowns[n][i].clone() for n, i in names)]
    ms, vs_ = [torch.zeros_like(x) for x in xs], [torch.zeros_like(x) for x in xs]
    trace = torch.empty(iterations, len(xs[0]), device=xs[0].device)
    # Adam's bias corrections, made once on the device: a compiled iteration takes its own as an input
    corrections = torch.tensor([[1 - ADAM_BETAS[0] ** t, math.sqrt(1 - ADAM_BETAS[1] ** t)]
                                for t in range(1, iterations + 1)], dtype=xs[0].dtype).to(xs[0].device)
    iteration = None  # built once: the extras' in_dims are the same every iteration

    for it in range(iterations):
        extra = per_step(it)
        iteration = iteration or _iteration(objective, names, list(batch.unknowns), signed, box,
                                            tuple(d for _, d in extra), batch.starts.device.type)
        lr = batch.hyper["lr"] * lr_factor(it)
        with torch.no_grad():  # torch.func's grad inside still differentiates; outside, nothing records a graph
            # a defense's candidate update may use the model's own parameters (requires_grad): without the
            # no_grad, each step's gradient would carry their graph and every later iterate would chain it
            xs, ms, vs_, loss = iteration(xs, ms, vs_, lr, corrections[it], batch.labels, batch.targets,
                                          batch.metadata, batch.hyper, *(e for e, _ in extra))
        if _CUDA_GRAPHS:  # a replay's outputs live in the graph's memory, which the next replay overwrites
            xs, ms, vs_ = ([t.clone() for t in ts] for ts in (xs, ms, vs_))
        trace[it] = loss.detach()
    images, unknowns = _as_variables(xs, names, list(batch.unknowns))
    return images, unknowns, trace


def _as_variables(flat: list[Tensor], names: list[tuple[str, int]],
                  groups: list[str]) -> tuple[Tensor, dict[str, list[Tensor]]]:
    """The images and the unknowns by name from the flat list of optimised variables."""
    unknowns: dict[str, list[Tensor]] = {n: [] for n in groups}
    for (n, _), x in zip(names, flat[1:]):
        unknowns[n].append(x)
    return flat[0], unknowns


def _iteration(objective: Callable[..., Tensor], names: list[tuple[str, int]], groups: list[str], signed: bool,
               box: tuple[Tensor, Tensor], extra_dims: tuple, device_type: str) -> Callable:
    """One Adam iteration on K problems: ``(xs, ms, vs, lr, corrections, *inputs) -> (xs, ms, vs, loss)``, a pure
    function (new tensors, inputs untouched) so that torch.compile can take it whole and CUDA graphs replay it."""
    step = batched(objective, extra_dims)
    beta1, beta2 = ADAM_BETAS
    lo, hi = box
    dtype = _AUTOCAST

    def iteration(xs, ms, vs, lr, corrections, labels, targets, metadata, hyper, *extras):
        with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            grads, loss = step(_as_variables(xs, names, groups), labels, targets, metadata, hyper, *extras)
        flat = [grads[0].detach(), *(grads[1][n][i].detach() for n, i in names)]
        if signed:
            flat = torch._foreach_sign(flat)
        # torch.optim.Adam's foreach step on every variable at once: a handful of kernels, not a handful per variable
        new_ms = torch._foreach_lerp(ms, flat, 1 - beta1)
        new_vs = torch._foreach_mul(vs, beta2)
        torch._foreach_addcmul_(new_vs, flat, flat, value=1 - beta2)
        denoms = torch._foreach_div(torch._foreach_sqrt(new_vs), corrections[1])
        torch._foreach_add_(denoms, ADAM_EPS)
        size = lr / corrections[0]  # each problem's step size, bias-corrected
        steps = torch._foreach_mul(torch._foreach_div(new_ms, denoms), [size.view((-1,) + (1,) * (x.dim() - 1)) for x in xs])
        new_xs = list(torch._foreach_sub(xs, steps))
        new_xs[0] = new_xs[0].clamp(lo, hi)
        return new_xs, new_ms, new_vs, loss

    if not _COMPILE:
        return iteration
    return torch.compile(iteration, dynamic=False, mode="reduce-overhead" if _CUDA_GRAPHS else None)


#: A model's clean update of candidate images with labels, on one path: plain autograd (``ThreatModel.candidate_update``)
#: alone, torch.func's (``candidate_update``) on the batched path. A vectorised attack's ``objective`` takes it, so both
#: paths minimise one loss.
Plain = Callable[[Tensor, Tensor], list[Tensor]]


def refuse_one_path_overrides(cls: type[Attack], one_problem_only: tuple[str, ...]) -> None:
    """Refuse, where it is defined, a subclass of a vectorised attack that overrides a method only its one-problem
    path runs (``one_problem_only``: ``reconstruct`` and its helpers) but not ``reconstruct_all``: the batched path
    would solve its problems without it."""
    overridden = [name for name in one_problem_only if name in vars(cls)]
    if overridden and "reconstruct_all" not in vars(cls):
        raise TypeError(f"{cls.__name__} overrides {overridden[0]} but not reconstruct_all: {cls.__mro__[1].__name__} "
                        "solves problems together through reconstruct_all, which would not run it; override "
                        "objective (the loss both paths minimise), or reconstruct_all as well")


def one_at_a_time(cls: type[Attack], problems: list[Problem]) -> list[Reconstruction]:
    """Each problem solved alone by ``cls``'s own ``reconstruct`` (plain autograd, the fastest path for one
    problem), timed and seeded as ``Attack.__call__`` does; ``max_problems: 1`` and large models on a CPU."""
    out = []
    for p in problems:
        start = time.perf_counter()
        with noise_from(p.threat.model, p.generator):
            rec = cls.reconstruct(p.attack, p.observed, p.threat, p.generator)
        rec.seconds = time.perf_counter() - start
        out.append(rec)
    return out


def like_problems(p: Problem, can_vectorise: Callable[[ThreatModel], bool], per_problem: Collection[str],
                  model: Callable[[nn.Module], Any] = model_key) -> tuple:
    """The key of the problems that run in one batched pass: one attack class with the same settings, except
    ``per_problem`` ones (whose values each problem keeps: a dict's names stay in the key), on models with the same
    ``model`` key, under one defense, protocol, batch size and update layout, all vectorisable or none. Generated
    from the attack's ``settings``, so a setting a subclass adds separates its problems without being listed."""
    a, t = p.attack, p.threat
    settings = tuple((k, tuple(sorted(v)) if isinstance(v, dict) else None) if k in per_problem else (k, repr(v))
                     for k, v in sorted(a.settings.items()))
    return (type(a), can_vectorise(t), model(t.model), repr(t.defense), t.protocol, t.batch_size, t.labels is None,
            tuple(p.observed.names), settings)


def solve_all(cls: type, problems: list[Problem], max_problems: int | None, *, per_problem: Collection[str],
              can_vectorise: Callable[[ThreatModel], bool], build: Callable,
              model: Callable[[nn.Module], Any] = model_key,
              images: Callable[[Problem], int] = lambda p: 1,
              rows: Callable[[Problem], int] = lambda p: 1, cap: int | None = None) -> list[Reconstruction]:
    """Like problems (``like_problems``) solved together by ``build``'s batches, ``max_problems`` at a time.

    ``images(p)`` and ``rows(p)`` scale one problem's footprint and count within its group (Monte Carlo
    points, restarts). Groups that cannot be vectorised, and chunks of one problem, are solved one at a
    time by ``cls.reconstruct``, unless iterations are replayed as CUDA graphs or run under autocast. ``cap`` bounds a chunk whatever
    memory allows.
    """
    def solve_group(group: list[Problem]) -> list[Reconstruction]:
        threat, n = group[0].threat, rows(group[0])
        if not can_vectorise(threat):
            return one_at_a_time(cls, group)
        per_chunk = max(1, chunk_size(max_problems, threat, threat.batch_size * images(group[0]), len(group) * n) // n)
        per_chunk = min(per_chunk, cap or per_chunk)
        # one replayed graph beats one problem's eager launches; autocast reaches the vectorised path only
        if per_chunk == 1 and not _CUDA_GRAPHS and _AUTOCAST is None:
            return one_at_a_time(cls, group)
        return run_chunks(group, build, per_chunk)

    return solve_grouped(problems, lambda p: like_problems(p, can_vectorise, per_problem, model), solve_group)


def run_chunks(problems: list[Problem], build: Callable[[list[Problem]], tuple[Batch, Callable[[Batch], tuple]]],
               chunk: int) -> list[Reconstruction]:
    """Build and solve the problems ``chunk`` at a time; each reconstruction gets its share of the chunk's time."""
    out: list[Reconstruction] = []
    for i in range(0, len(problems), chunk):
        part = problems[i:i + chunk]
        start = time.perf_counter()
        batch, solve = build(part)
        recs = solve(batch)
        seconds = (time.perf_counter() - start) / len(part)
        for r in recs:
            r.seconds = seconds
        out.extend(recs)
    return out


def defense_candidate(defense: Defense) -> bool:
    """Whether the defense centres its likelihood on its own candidate update (DP-SGD's clipped mean)."""
    return type(defense).candidate_update is not Defense.candidate_update


def group_by(problems: list[Problem], key: Callable[[Problem], Any]) -> list[list[int]]:
    """Indices of ``problems`` grouped by ``key``, groups in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(problems):
        groups.setdefault(key(p), []).append(i)
    return list(groups.values())


def solve_grouped(problems: list[Problem], key: Callable[[Problem], Any],
                  solve_group: Callable[[list[Problem]], list[Reconstruction]]) -> list[Reconstruction]:
    """Solve each group of like problems together and return the reconstructions in the input order."""
    out: list[Reconstruction | None] = [None] * len(problems)
    for idx in group_by(problems, key):
        for i, rec in zip(idx, solve_group([problems[i] for i in idx])):
            out[i] = rec
    return cast(list[Reconstruction], out)  # every index is in one group
