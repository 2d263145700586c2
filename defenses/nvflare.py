"""NVIDIA FLARE's privacy filters as a team configures them (``task_result_filters`` of a client's job; NVFlare 2.9,
``leakaudit[nvflare]``): PercentilePrivacy, ExcludeVars and SVTPrivacy (Roth et al. 2022).

The update is filtered by FLARE's own filter class, called on it as a WEIGHT_DIFF DXO in a Shareable with a bare
FLContext (as FLARE's unit tests call them), so that what leaves is exactly what FLARE makes of it. The deterministic
filters' likelihood is the zero-noise limit around the candidate filtered as FLARE filters it, written in torch so
that it is differentiable and runs under vmap (the tests hold it equal to FLARE's own output); SVTPrivacy's is the
Laplace noise on the coordinates it sends. SVTPrivacy draws from NumPy's global generator, which is seeded from the
round's generator for the call and put back after it.

FLARE is imported where it is used; without it, each defense is refused in one line naming the extra.
"""
from __future__ import annotations

import math
import re
from importlib.util import find_spec
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from leakaudit.defenses.chain import Chain
from leakaudit.defenses.flower import MEANINGFUL_EPSILON, framework_refusal, from_arrays, numpy_draws_from, to_arrays
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.defense import Defense, DeterministicDefense, PrivacyProfile, SharedUpdate
from leakaudit.plugins.protocol import Protocol, parameter_names


def nvflare_missing() -> str | None:
    """Why FLARE's filters cannot run here (None: they can), found without importing FLARE."""
    return None if find_spec("nvflare") else "needs NVIDIA FLARE: pip install 'leakaudit[nvflare]'"


def run_filter(dxo_filter: Any, arrays: dict[str, Any]) -> dict[str, Any]:
    """``arrays`` (name: array, the model's change) through the FLARE filter ``dxo_filter``: a WEIGHT_DIFF DXO in a
    Shareable, filtered by the filter's own ``process`` under a bare FLContext; the arrays it returns."""
    from nvflare.apis.dxo import DXO, DataKind, from_shareable
    from nvflare.apis.fl_context import FLContext

    shareable = DXO(data_kind=DataKind.WEIGHT_DIFF, data=arrays).to_shareable()
    return dict(from_shareable(dxo_filter.process(shareable, FLContext())).data)



class FlareDefense(DeterministicDefense):
    """What FLARE's deterministic filters share: the extra, one client's update, the paper."""

    paper = "Roth et al. 2022"
    #: Whether the filter sends of full weights what it sends of their change (ExcludeVars: the same tensors left out).
    same_on_weights = False

    def unsupported(self, protocol: Protocol) -> str | None:
        return framework_refusal(self.name, nvflare_missing(), "filter", protocol)


def numpy_percentile(values: Tensor, q: float) -> Tensor:
    """``np.percentile(values, q)`` (its default, linear interpolation, and its lerp) in torch, under vmap."""
    ordered = values.sort().values
    position = q / 100 * (ordered.shape[-1] - 1)
    low = math.floor(position)
    high = min(low + 1, ordered.shape[-1] - 1)
    t = position - low
    a, b = ordered[..., low], ordered[..., high]
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


class FlarePercentile(FlareDefense):
    """FLARE's PercentilePrivacy (Shokri & Shmatikov 2015's "largest values to share"): the coordinates whose
    magnitude is under the ``percentile``-th percentile of all the update's magnitudes are zeroed, the others
    clipped to [-gamma, gamma]. No noise: no differential-privacy guarantee, whatever the settings. Filters a
    model's change; under fedsgd the gradient is filtered as a change at learning rate 1. Needs
    ``leakaudit[nvflare]``."""

    name = "nvflare_percentile"
    sparsifies = True
    params = {
        "percentile": Param(10.0, float, min=0.0, max=100.0, protects="higher",
                            help="PercentilePrivacy's percentile: the share (%) of smallest magnitudes zeroed"),
        "gamma": Param(0.01, float, min=0.0, exclusive_min=True,
                       help="PercentilePrivacy's gamma: the magnitude the shared values are clipped to"),
    }
    percentile: float
    gamma: float

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        """FLARE's ``PercentilePrivacy.process`` on the update."""
        from nvflare.app_common.filters import PercentilePrivacy

        filtered = run_filter(PercentilePrivacy(percentile=self.percentile, gamma=self.gamma),
                              {f"{i:06d}": a for i, a in enumerate(to_arrays(update))})
        return from_arrays([filtered[f"{i:06d}"] for i in range(len(update))], update)

    def transform(self, update: Sequence[Tensor]) -> list[Tensor]:
        """What PercentilePrivacy makes of ``update``, differentiably (the cutoff from the update's magnitudes as
        NumPy's percentile takes it; a 0-d tensor passes unchanged, as FLARE passes a scalar)."""
        magnitudes = torch.cat([g.detach().abs().reshape(-1) for g in update])
        cutoff = numpy_percentile(magnitudes, self.percentile)
        return [g if g.dim() == 0 else torch.where(g.detach().abs() < cutoff, torch.zeros_like(g),
                                                    g.clamp(-self.gamma, self.gamma)) for g in update]

    def output_radius(self, radius: float | None) -> float | None:
        return radius  # zeroing and clipping coordinates never lengthens the update

    def privacy_profile(self, radius: float | None = None) -> PrivacyProfile:
        return PrivacyProfile(mu=math.inf, mechanism=(
            f"NVFlare PercentilePrivacy: magnitudes under the {self.percentile:g}th percentile zeroed, the rest "
            f"clipped to {self.gamma:g}; WARNING: not differential privacy: no noise is added, so no epsilon bounds "
            "what it leaks"))


class FlareExcludeVars(FlareDefense):
    """FLARE's ExcludeVars: the named tensors (a list of parameter names, or a regular expression searched in each
    name) are removed from the update, the rest shared unchanged. The server learns nothing of the excluded tensors:
    they are sent as zeros, left out of gradient matching (``defended_tensors``) and of the likelihood, which is
    exact on the rest. Needs ``leakaudit[nvflare]``."""

    name = "nvflare_exclude_vars"
    same_on_weights = True
    params = {
        "exclude_vars": Param(None, (list, str), example="bias$",
                              help="ExcludeVars' exclude_vars: parameter names, or a regular expression (none, or an "
                                   "empty one: nothing excluded, as FLARE runs it)"),
    }
    exclude_vars: list | str | None

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        if isinstance(self.exclude_vars, list) and not all(isinstance(v, str) for v in self.exclude_vars):
            raise ValueError(f"nvflare_exclude_vars: exclude_vars {self.exclude_vars!r}; expected parameter names "
                             "(strings) or one regular expression")
        if isinstance(self.exclude_vars, str):
            try:
                re.compile(self.exclude_vars)
            except re.error as error:
                raise ValueError(f"nvflare_exclude_vars: exclude_vars {self.exclude_vars!r} is not a regular "
                                 f"expression ({error})") from None
        self.names: list[str] | None = None

    def excluded(self, names: Sequence[str]) -> set[str]:
        """The names ExcludeVars removes, as it matches them."""
        if isinstance(self.exclude_vars, str):
            pattern = re.compile(self.exclude_vars) if self.exclude_vars else None
            return {n for n in names if pattern is not None and pattern.search(n)}
        return set(names) & set(self.exclude_vars or [])

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Leaves the model as it is; reads its parameter names (a listed name the model lacks is one line)."""
        self.names = parameter_names(model)
        if isinstance(self.exclude_vars, list):
            unknown = [v for v in self.exclude_vars if v not in self.names]
            if unknown:
                raise ValueError(f"nvflare_exclude_vars: exclude_vars names {', '.join(unknown)}, not a trainable "
                                 f"parameter of the model; choices: {', '.join(self.names)}")
        dropped = self.excluded(self.names)
        self.model_changes = [f"not shared (ExcludeVars): {', '.join(n for n in self.names if n in dropped) or 'none'}"]
        return model

    def _names(self, update: Sequence[Tensor]) -> list[str]:
        if self.names is None or len(self.names) != len(update):
            raise ValueError("nvflare_exclude_vars: the model's parameter names are unknown; call wrap_model(model) "
                             "first")
        return self.names

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        """FLARE's ``ExcludeVars.process`` on the update by parameter name; a removed tensor is sent as zeros."""
        from nvflare.app_common.filters import ExcludeVars

        names = self._names(update)
        kept = run_filter(ExcludeVars(exclude_vars=self.exclude_vars), dict(zip(names, to_arrays(update))))
        return [from_arrays([kept[n]], [g])[0] if n in kept else torch.zeros_like(g) for n, g in zip(names, update)]

    def transform(self, update: Sequence[Tensor]) -> list[Tensor]:
        dropped = self.excluded(self._names(update))
        return [torch.zeros_like(g) if n in dropped else g for n, g in zip(self._names(update), update)]

    def defended_tensors(self, names: Sequence[str]) -> set[str]:
        return self.excluded(names)

    def output_radius(self, radius: float | None) -> float | None:
        return radius


def svt_epsilons(fraction: float, epsilon: float, noise_var: float, parameters: int,
                 epsilon_threshold: float | None = None, epsilon_query: float | None = None,
                 epsilon_release: float | None = None) -> dict[str, float]:
    """SVTPrivacy's budget for an update of ``parameters`` coordinates, split by FLARE's own functions: ``n_upload``
    (ceil(fraction * parameters)), the threshold's, the queries' and the release's epsilon, ``flare`` (what FLARE's
    accountant records: their sum) and ``worst``, what one round really spends (see ``FlareSvt``)."""
    from nvflare.app_common.filters.svt_privacy import _compute_epsilon_split, _compute_release_epsilon

    n_upload = int(min(math.ceil(parameters * fraction), parameters))
    threshold, query = _compute_epsilon_split(epsilon, n_upload, epsilon_threshold, epsilon_query)
    release = _compute_release_epsilon(n_upload, noise_var, epsilon_release)
    return {"n_upload": n_upload, "threshold": threshold, "query": query, "release": release,
            "flare": threshold + query + release, "worst": threshold + query * parameters / n_upload + release}


class FlareSvt(Defense):
    """FLARE's SVTPrivacy: the sparse vector technique (Lyu et al. 2017, Alg. 1) picks ``n_upload = ceil(fraction *
    parameters)`` coordinates whose clipped magnitude |clip(g, gamma)| passes a noisy threshold (tau plus
    Laplace(gamma / epsilon_threshold); each query plus Laplace(2 n_upload gamma / epsilon_query)); each picked
    coordinate is sent clipped to [-gamma, gamma] plus Laplace(2 n_upload gamma / epsilon_release) noise
    (epsilon_release = n_upload * noise_var unless given), the rest as zeros.

    What one round spends: the release is epsilon_release-DP (L1 sensitivity 2 gamma n_upload), which grows with the
    model: noise_var per coordinate sent. The selection is SVT's epsilon_threshold + epsilon_query only for at most
    n_upload answers above the threshold; FLARE answers every coordinate of a pass at once, so up to ``parameters``
    can pass, and SVT's bound grows to epsilon_threshold + epsilon_query * parameters / n_upload (Lyu et al. 2017:
    epsilon_query / n_upload for each answer above the threshold). Pure DP (delta 0), composed by addition over rounds.

    The likelihood is the Laplace release on the coordinates sent (a sent value is non-zero almost surely), around
    the candidate clipped to gamma. It leaves out what the choice of coordinates says of the candidate: that choice
    is the selection's epsilon-DP, so the likelihood ratio it leaves out is within e^(+-selection epsilon) (about
    e^1.1 at FLARE's defaults), and ``bayes`` attacks the released values exactly. Needs ``leakaudit[nvflare]``."""

    name = "nvflare_svt"
    paper = "Roth et al. 2022"
    same_on_weights = False  # as FlareDefense's
    params = {
        "fraction": Param(0.1, float, min=0.0, max=1.0, exclusive_min=True,
                          help="SVTPrivacy's fraction: the share of coordinates sent"),
        "epsilon": Param(0.1, float, min=0.0, exclusive_min=True, protects="lower",
                         help="SVTPrivacy's epsilon: the selection's budget (threshold and queries)"),
        "noise_var": Param(0.1, float, min=0.0, exclusive_min=True, protects="lower",
                           help="SVTPrivacy's noise_var: the release's epsilon per coordinate sent (its noise: "
                                "Laplace(2 gamma / noise_var))"),
        "gamma": Param(1e-5, float, min=0.0, exclusive_min=True, help="SVTPrivacy's gamma: the clip"),
        "tau": Param(1e-6, float, help="SVTPrivacy's tau: the threshold before its noise"),
        "replace": Param(True, bool, help="SVTPrivacy's replace: the coordinates sent drawn with replacement"),
        "epsilon_threshold": Param(None, float, min=0.0, exclusive_min=True,
                                   help="SVTPrivacy's epsilon_threshold (default: SVT's split of epsilon)"),
        "epsilon_query": Param(None, float, min=0.0, exclusive_min=True,
                               help="SVTPrivacy's epsilon_query (default: the rest of epsilon)"),
        "epsilon_release": Param(None, float, min=0.0, exclusive_min=True,
                                 help="SVTPrivacy's epsilon_release (default: n_upload * noise_var)"),
        "parameters": Param(None, int, min=1, help="the coordinates of the update the epsilon is stated for "
                                                   "(default: the audited model's trainable parameters)"),
        "rounds": Param(1, int, min=1, help="server rounds the epsilon is stated over in the report"),
    }
    fraction: float
    epsilon: float
    noise_var: float
    gamma: float
    tau: float
    replace: bool
    epsilon_threshold: float | None
    epsilon_query: float | None
    epsilon_release: float | None
    parameters: int | None
    rounds: int

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.seen: int | None = None  # the coordinates of the model wrapped, or of the last update filtered

    def unsupported(self, protocol: Protocol) -> str | None:
        return framework_refusal(self.name, nvflare_missing(), "filter", protocol)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.seen = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return model

    def budget(self, parameters: int) -> dict[str, float]:
        return svt_epsilons(self.fraction, self.epsilon, self.noise_var, parameters, self.epsilon_threshold,
                            self.epsilon_query, self.epsilon_release)

    def release_scale(self, parameters: int) -> float:
        """The Laplace scale on each coordinate sent: 2 gamma n_upload / epsilon_release, as SVTPrivacy sets it."""
        spent = self.budget(parameters)
        return 2 * self.gamma * spent["n_upload"] / spent["release"]

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        """FLARE's ``SVTPrivacy.process`` on the update, NumPy's global generator (where it draws) seeded from
        ``generator`` for the call and put back after."""
        from nvflare.app_common.filters import SVTPrivacy

        self.seen = sum(t.numel() for t in update)
        svt = SVTPrivacy(fraction=self.fraction, epsilon=self.epsilon, noise_var=self.noise_var, gamma=self.gamma,
                         tau=self.tau, replace=self.replace, epsilon_threshold=self.epsilon_threshold,
                         epsilon_query=self.epsilon_query, epsilon_release=self.epsilon_release)
        with numpy_draws_from(generator):
            filtered = run_filter(svt, {f"{i:06d}": a for i, a in enumerate(to_arrays(update))})
        return from_arrays([filtered[f"{i:06d}"] for i in range(len(update))], update)

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """Laplace(release scale) on the coordinates sent (non-zero), around the candidate clipped to gamma."""
        scale = self.release_scale(sum(t.numel() for t in observed.tensors))
        parts = [torch.where(o != 0, -(o - c.clamp(-self.gamma, self.gamma)).abs() / scale, torch.zeros_like(o)).sum()
                 for o, c in zip(observed.tensors, candidate)]
        return torch.stack(parts).sum()

    def privacy_profile(self, radius: float | None = None) -> PrivacyProfile:
        count = self.parameters or self.seen
        settings = (f"NVFlare SVTPrivacy: fraction {self.fraction:g}, epsilon {self.epsilon:g}, noise_var "
                    f"{self.noise_var:g}, gamma {self.gamma:g}")
        if count is None:
            return PrivacyProfile(mu=math.inf, mechanism=(
                f"{settings}; its epsilon grows with the update's size (noise_var per coordinate sent), unknown "
                "here: give parameters"))
        spent = self.budget(count)
        per_round = spent["worst"]
        notes = [f"epsilon {per_round:.6g} per round (delta 0), {per_round * self.rounds:.6g} over {self.rounds} "
                 f"rounds, for {count} coordinates: the release {spent['release']:.6g} ({spent['n_upload']} "
                 f"coordinates sent), the selection at most {spent['threshold'] + spent['query'] * count / spent['n_upload']:.3g}"
                 f" (FLARE's accountant records {spent['flare']:.6g})",
                 f"noise scale {self.release_scale(count):.3g} on values clipped to {self.gamma:g}"]
        if per_round > MEANINGFUL_EPSILON:
            notes.append(f"WARNING: epsilon {per_round:.3g} per round is past any meaningful range (above "
                         f"{MEANINGFUL_EPSILON:g})")
        return PrivacyProfile(pairs=((per_round, 0.0),), mechanism=f"{settings}; " + "; ".join(notes))

    def privacy_spent(self, steps: int, sample_rate: float, delta: float) -> float | None:
        """Epsilon (delta 0) after ``steps`` rounds, by pure composition, where the update's size is known."""
        count = self.parameters or self.seen
        return None if count is None else steps * self.budget(count)["worst"]


#: FLARE's filter classes an NVFlare job may name in its task_result_filters, and the defense each is audited as.
JOB_FILTERS: dict[str, type[FlareDefense] | type[FlareSvt]] = {
    "ExcludeVars": FlareExcludeVars, "PercentilePrivacy": FlarePercentile, "SVTPrivacy": FlareSvt}
#: The DXO kinds FLARE's privacy filters support (their data_kinds choices, each filter's default: both).
FILTER_KINDS = ("WEIGHT_DIFF", "WEIGHTS")
#: FLARE's client API executor (ScriptRunner's), which sends full weights unless its params_transfer_type is DIFF.
CLIENT_API = "ClientAPIExecutor"


def job_filters(path: str, task: str, parameters: int | None = None) -> list[Defense]:
    """The defenses of the filters an NVFlare job's client configuration (its config_fed_client.json, as FLARE's job
    API and recipes export it) applies to ``task``'s result, in order: each ``task_result_filters`` entry whose
    ``tasks`` name it (or "*"), each filter by its ``path`` (or ``name``) and ``args`` (``parameters``, where given,
    to SVTPrivacy's), where its ``data_kinds`` hold the kind the task's executor sends. ValueError, on one line, for
    a file that is not such JSON, a filter other than FLARE's privacy filters, an argument leakaudit does not read,
    or a filter on full weights (what leakaudit audits is the model's change)."""
    import json
    from pathlib import Path

    try:
        job = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"nvflare_job: path {path!r} is not an NVFlare job's JSON ({one_line(error)})") from None
    entries = job.get("task_result_filters", []) if isinstance(job, dict) else None
    if not isinstance(entries, list):
        raise ValueError("nvflare_job: the job's task_result_filters is not a list")
    kind = sent_kind(job, task)
    members: list[Defense] = []
    for i, entry in enumerate(entries):
        tasks = entry.get("tasks", []) if isinstance(entry, dict) else []
        if task in tasks or "*" in tasks:
            for j, given in enumerate(entry.get("filters", [])):
                member = job_filter(given, f"nvflare_job: task_result_filters[{i}].filters[{j}]", kind, parameters)
                members.extend([member] if member is not None else [])
    if not members:
        raise ValueError(f"nvflare_job: the job filters no {kind} result of task {task!r}: its update is sent as it "
                         "is (audit it as defense none)")
    for j, m in enumerate(members[:-1]):
        if not m.deterministic:
            raise ValueError(f"nvflare_job: {m.name} (filter {j + 1} of {len(members)}) is random; only the "
                             "last filter may be (its likelihood is that of the filters before it applied to the "
                             "candidate)")
    return members


def sent_kind(job: dict, task: str) -> str:
    """The DXO kind ``task``'s executor sends: FLARE's client API executor sends WEIGHTS (params_transfer_type
    FULL, its default) or WEIGHT_DIFF (DIFF); leakaudit reads any other executor's result as the model's change."""
    for entry in job.get("executors", []) if isinstance(job.get("executors"), list) else []:
        tasks = entry.get("tasks", []) if isinstance(entry, dict) else []
        executor = entry.get("executor", {}) if task in tasks or "*" in tasks else None
        if isinstance(executor, dict):
            args = executor.get("args", {}) or {}
            if str(executor.get("path") or executor.get("name") or "").endswith(CLIENT_API) \
                    or "params_transfer_type" in args:
                return "WEIGHT_DIFF" if str(args.get("params_transfer_type", "FULL")).upper() == "DIFF" else "WEIGHTS"
    return "WEIGHT_DIFF"


def job_filter(given: Any, where: str, kind: str, parameters: int | None) -> Defense | None:
    """One filter entry of a job as the defense it is audited as; None where its data_kinds leave ``kind`` alone, as
    FLARE's DXOFilter passes a DXO of a kind it does not filter."""
    if not isinstance(given, dict):
        raise ValueError(f"{where} is not a component ({{path, args}})")
    named = str(given.get("path") or given.get("name") or "").rsplit(".", 1)[-1]  # the class
    defense = JOB_FILTERS.get(named)
    if defense is None:
        raise ValueError(f"{where}: filter {named!r} is not one leakaudit audits; choices: "
                         f"{', '.join(sorted(JOB_FILTERS))}")
    args = dict(given.get("args", {}) or {})
    kinds = args.pop("data_kinds", None) or list(FILTER_KINDS)  # FLARE's default where empty
    if not isinstance(kinds, list) or any(k not in FILTER_KINDS for k in kinds):
        raise ValueError(f"{where}: {named}'s data_kinds {kinds!r}; choices: {', '.join(FILTER_KINDS)}")
    if kind not in kinds:
        return None
    if kind == "WEIGHTS" and not defense.same_on_weights:
        raise ValueError(f"{where}: {named} filters full weights here (the task's {CLIENT_API} sends WEIGHTS: "
                         "params_transfer_type FULL, its default), which leakaudit does not audit; send the model's "
                         "change (params_transfer_type DIFF, ScriptRunner's params_transfer_type=TransferType.DIFF)")
    unknown = [k for k in args if k not in defense.params or k in OWN]
    if unknown:
        raise ValueError(f"{where}: {named}'s {', '.join(unknown)} is not read by leakaudit; choices: "
                         f"{', '.join(['data_kinds', *(k for k in defense.params if k not in OWN)])}")
    try:
        return defense(**args, **({"parameters": parameters} if defense is FlareSvt and parameters else {}))
    except ValueError as error:
        raise ValueError(f"{where}: {one_line(error)}") from None


#: Parameters of the nvflare_* defenses that are leakaudit's own, not a FLARE filter's argument.
OWN = ("parameters", "rounds")


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


class FlareJob(Chain):
    """An NVFlare job's result filters as configured: the filters its client configuration
    (``config_fed_client.json``) applies to ``task``'s result, read from ``path`` before any work (an unknown filter
    is one line naming it), applied in order as a chain of the ``nvflare_*`` defenses (the last may be random:
    SVTPrivacy). Needs ``leakaudit[nvflare]``."""

    name = "nvflare_job"
    paper = "Roth et al. 2022"
    params = {
        "path": Param(type=str, example="config_fed_client.json", file=True,
                      help="the job's client configuration (an exported job's app_SITE/config/config_fed_client.json; "
                           "relative: beside the audit file)"),
        "task": Param("train", str, help="the task whose result is audited"),
        "parameters": Param(None, int, min=1, help="an SVTPrivacy filter's parameters (nvflare_svt's): the "
                                                   "coordinates its epsilon is stated for"),
    }
    path: str
    task: str
    parameters: int | None

    def __init__(self, **settings: Any) -> None:
        Defense.__init__(self, **settings)
        self.members = job_filters(self.path, self.task, self.parameters)
        self.deterministic = all(m.deterministic for m in self.members)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"FlareJob({self.path}: " + " > ".join(map(repr, self.members)) + ")"


@hookimpl
def register_defenses():
    return [FlarePercentile, FlareExcludeVars, FlareSvt, FlareJob]
