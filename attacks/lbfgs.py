"""L-BFGS for many problems at once, as ``dlg`` and ``idlg`` run it.

``BatchedLBFGS`` keeps each problem's iterate, step and strong-Wolfe line search of its own, and runs the work
the problems share as batched passes: the loss evaluations of every problem that asks (one vmapped pass) and the
two-loop recursion over the stored curvature pairs, held as (problems, history, 2, n) tensors. It takes the steps
torch.optim.LBFGS takes (Liu & Nocedal 1989; the line search is Algorithms 3.5 and 3.6 of Nocedal & Wright 2006,
with cubic interpolation), with the line search's scalars in double precision.

``LockStep`` runs torch.optim.LBFGS itself for each problem, one thread each, and batches only the evaluations:
the reference that the tests hold ``BatchedLBFGS`` to, and the baseline of benchmarks/lbfgs_batching.py.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generator, cast

import torch
from torch import Tensor

#: Curvature pairs with ``y . s`` at or below this are not stored (torch.optim.LBFGS's rule).
CURVATURE_MIN = 1e-10
#: The strong-Wolfe constants: sufficient decrease and curvature.
C1, C2 = 1e-4, 0.9
#: The zoom stops on a bracket this narrow (torch.optim.LBFGS leaves it at this default whatever ``tolerance_change``).
ZOOM_TOLERANCE = 1e-9


@dataclass(frozen=True)
class LBFGSSettings:
    """torch.optim.LBFGS's settings, with its defaults but ``history_size`` and the line search."""

    lr: float = 1.0
    max_iter: int = 20
    history_size: int = 100
    line_search: bool = True
    tolerance_grad: float = 1e-7
    tolerance_change: float = 1e-9

    @property
    def max_eval(self) -> int:
        return self.max_iter * 5 // 4


@dataclass
class Evaluate:
    """A solver's request: the loss and gradient at ``x`` (flat), and the slope along ``along`` if given."""

    x: Tensor
    along: Tensor | None = None


@dataclass
class Point:
    """An evaluated point: the loss, its gradient, the slope along the requested direction, the largest |gradient|."""

    loss: float
    grad: Tensor
    slope: float
    grad_max: float


@dataclass
class Direction:
    """A solver's request for its L-BFGS direction at ``grad``: the first of a run (the history is cleared), or after
    the step ``step * previous`` that moved the gradient from ``previous_grad`` (a new curvature pair)."""

    grad: Tensor
    first: bool
    previous_grad: Tensor | None = None
    previous: Tensor | None = None
    step: float = 0.0


@dataclass
class Directed:
    """The direction ``d``, the slope ``grad . d``, ``max |d|`` and ``sum |grad|`` (the first step's size)."""

    d: Tensor
    slope: float
    d_max: float
    grad_sum: float


Request = Evaluate | Direction
Solver = Generator[Request, Any, Any]


@dataclass
class _Iterate:
    """What torch.optim.LBFGS keeps between ``step`` calls, for one problem."""

    x: Tensor
    n_iter: int = 0
    d: Tensor | None = None
    t: float = 0.0
    grad: Tensor | None = None
    loss: float = math.nan


def minimise(x: Tensor, steps: int, settings: LBFGSSettings) -> Generator[Request, Any, tuple[Tensor, list[float]]]:
    """``steps`` calls of torch.optim.LBFGS's ``step`` from the flat ``x``, as a solver for ``BatchedLBFGS``: the
    final ``x`` and each step's starting loss. It stops early at a loss that is not finite or exactly zero."""
    state, losses = _Iterate(x), []
    for _ in range(steps):
        loss = yield from _step(state, settings)
        losses.append(loss)
        if not math.isfinite(loss) or loss == 0.0:
            break
    return state.x, losses


def _step(s: _Iterate, c: LBFGSSettings) -> Generator[Request, Any, float]:
    """One ``step``: up to ``max_iter`` iterations and ``max_eval`` evaluations; the loss it started from."""
    at = yield Evaluate(s.x)
    start, loss, grad, grad_max, evaluations = at.loss, at.loss, at.grad, at.grad_max, 1
    if grad_max <= c.tolerance_grad:
        return start
    for n in range(1, c.max_iter + 1):
        s.n_iter += 1
        first = s.n_iter == 1
        direction = yield Direction(grad, first, s.grad, s.d, s.t)
        s.d, s.grad, s.loss = direction.d, grad, loss
        s.t = t = (min(1.0, _ratio(1.0, direction.grad_sum)) if first else 1.0) * c.lr
        if direction.slope > -c.tolerance_change:
            break
        if c.line_search:
            found, t, spent = yield from _strong_wolfe(s.x, t, s.d, Point(loss, grad, direction.slope, grad_max),
                                                       direction.d_max, c.max_eval - evaluations)
            s.x = s.x.add(s.d, alpha=t)
            loss, grad, grad_max = found.loss, found.grad, found.grad_max
            optimal = grad_max <= c.tolerance_grad
        else:
            s.x, spent, optimal = s.x.add(s.d, alpha=t), 0, False
            if n != c.max_iter:
                at = yield Evaluate(s.x)
                loss, grad, grad_max, spent = at.loss, at.grad, at.grad_max, 1
                optimal = grad_max <= c.tolerance_grad
        s.t, evaluations = t, evaluations + spent
        if (n == c.max_iter or evaluations >= c.max_eval or optimal or direction.d_max * abs(t) <= c.tolerance_change
                or abs(loss - s.loss) < c.tolerance_change):
            break
    return start


def _ratio(a: float, b: float) -> float:
    """``a / b`` as IEEE arithmetic gives it (torch's tensors do), where Python would raise at ``b == 0``."""
    if b != 0:
        return a / b
    return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)


def _cubic_minimum(x1: float, f1: float, g1: float, x2: float, f2: float, g2: float,
                   bounds: tuple[float, float] | None = None) -> float:
    """The minimiser of the cubic through two points with their slopes, within ``bounds`` (the points' interval
    by default); the bounds' midpoint where the cubic has no minimum."""
    low, high = bounds if bounds is not None else ((x1, x2) if x1 <= x2 else (x2, x1))
    d1 = g1 + g2 - 3 * _ratio(f1 - f2, x1 - x2)
    d2_square = d1 ** 2 - g1 * g2
    if not d2_square >= 0:
        return (low + high) / 2.0
    d2 = math.sqrt(d2_square)
    if x1 <= x2:
        at = x2 - (x2 - x1) * _ratio(g2 + d2 - d1, g2 - g1 + 2 * d2)
    else:
        at = x1 - (x1 - x2) * _ratio(g1 + d2 - d1, g1 - g2 + 2 * d2)
    return min(max(at, low), high)


def _strong_wolfe(x: Tensor, t: float, d: Tensor, start: Point, d_max: float, max_ls: int) -> Generator[Request, Any, tuple[Point, float, int]]:
    """A step along ``d`` that meets the strong Wolfe conditions: bracket, then zoom. The point found, its step and
    the evaluations spent."""
    f, gtd = start.loss, start.slope
    new = yield Evaluate(x.add(d, alpha=t), d)
    spent, ls_iter, done = 1, 0, False
    t_prev, prev = 0.0, start
    bracket: list[tuple[float, Point]] = []
    while ls_iter < max_ls:
        if new.loss > f + C1 * t * gtd or (ls_iter > 1 and new.loss >= prev.loss):
            bracket = [(t_prev, prev), (t, new)]
            break
        if abs(new.slope) <= -C2 * gtd:
            bracket, done = [(t, new)], True
            break
        if new.slope >= 0:
            bracket = [(t_prev, prev), (t, new)]
            break
        bounds = (t + 0.01 * (t - t_prev), t * 10)
        t_prev, t = t, _cubic_minimum(t_prev, prev.loss, prev.slope, t, new.loss, new.slope, bounds)
        prev = new
        new = yield Evaluate(x.add(d, alpha=t), d)
        spent, ls_iter = spent + 1, ls_iter + 1
    if ls_iter == max_ls:
        bracket = [(0.0, start), (t, new)]
    low, high = _ends(bracket)
    stalled = False
    while not done and ls_iter < max_ls:
        (a, at_a), (b, at_b) = bracket
        if abs(b - a) * d_max < ZOOM_TOLERANCE:
            break
        t = _cubic_minimum(a, at_a.loss, at_a.slope, b, at_b.loss, at_b.slope)
        t, stalled = _away_from_ends(t, min(a, b), max(a, b), stalled)
        new = yield Evaluate(x.add(d, alpha=t), d)
        spent, ls_iter = spent + 1, ls_iter + 1
        if new.loss > f + C1 * t * gtd or new.loss >= bracket[low][1].loss:
            bracket[high] = (t, new)
            low, high = _ends(bracket)
        else:
            if abs(new.slope) <= -C2 * gtd:
                done = True
            elif new.slope * (bracket[high][0] - bracket[low][0]) >= 0:
                bracket[high] = bracket[low]
            bracket[low] = (t, new)
    t, found = bracket[low]
    return found, t, spent


def _ends(bracket: list[tuple[float, Point]]) -> tuple[int, int]:
    """Which end of the bracket has the lower loss, and which the higher."""
    return (0, 1) if bracket[0][1].loss <= bracket[-1][1].loss else (1, 0)


def _away_from_ends(t: float, low: float, high: float, stalled: bool) -> tuple[float, bool]:
    """The zoom's safeguard: a trial within a tenth of the bracket from an end is moved in to that tenth when the
    last trial was also that close (or it left the bracket); whether this trial was too close."""
    eps = 0.1 * (high - low)
    if not min(high - t, t - low) < eps:  # NaN included, as torch.optim.LBFGS has it
        return t, False
    if stalled or t >= high or t <= low:
        return (high - eps if abs(t - high) < abs(t - low) else low + eps), False
    return t, True


class BatchedLBFGS:
    """Runs one solver per problem (a generator such as ``minimise``) and answers their requests in batched passes.

    ``evaluate(rows, x)`` returns the losses (R,) and gradients (R, n) of problems ``rows`` at their flat iterates
    ``x`` (R, n). Each round answers every waiting request for a direction, then every waiting evaluation; a solver's
    own scalars (its line search) are read from one host copy per pass.

    Each problem's curvature pairs sit in chronological order in a window of a buffer twice the history long, so
    that the two-loop recursion walks the same columns for every problem, without gathering them; when a window
    would run off the end, every window moves back to the start.
    """

    def __init__(self, evaluate: Callable[[list[int], Tensor], tuple[Tensor, Tensor]], problems: int, size: int,
                 history_size: int, device: torch.device, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or torch.get_default_dtype()
        self.evaluate, self.history = evaluate, history_size
        self.pairs = torch.zeros(problems, 2 * history_size, 2, size, device=device, dtype=dtype)  # (s, y)
        self.rho = torch.zeros(problems, 2 * history_size, device=device, dtype=dtype)
        self.first = torch.zeros(problems, dtype=torch.long, device=device)  # each window's first column
        self.count = torch.zeros(problems, dtype=torch.long, device=device)
        self.h_diag = torch.ones(problems, device=device, dtype=dtype)

    def run(self, solvers: list[Solver]) -> list[Any]:
        """Each solver's return value, in order."""
        results: list[Any] = [None] * len(solvers)
        waiting: dict[int, Request] = {}

        def answer(i: int, value: Any) -> None:
            try:
                waiting[i] = solvers[i].send(value)
            except StopIteration as stop:
                results[i] = stop.value
                waiting.pop(i, None)

        for i in range(len(solvers)):
            answer(i, None)
        while waiting:
            serves: tuple[tuple[type, Callable[[list[int], list[Any]], list[Any]]], ...] = (
                (Direction, self._directions), (Evaluate, self._evaluations))
            for kind, serve in serves:
                rows = [i for i, r in waiting.items() if isinstance(r, kind)]
                if rows:
                    for i, value in zip(rows, serve(rows, [waiting[i] for i in rows])):
                        answer(i, value)
        return results

    def _evaluations(self, rows: list[int], asks: list[Evaluate]) -> list[Point]:
        x = torch.stack([a.x for a in asks])
        loss, grad = self.evaluate(rows, x)
        zero = x.new_zeros(x.shape[1])
        slope = torch.linalg.vecdot(grad, torch.stack([zero if a.along is None else a.along for a in asks]))
        numbers = torch.stack([loss.to(grad.dtype), slope, grad.abs().amax(-1)]).tolist()
        return [Point(f, grad[j], s, m) for j, (f, s, m) in enumerate(zip(*numbers))]

    def _directions(self, rows: list[int], asks: list[Direction]) -> list[Directed]:
        """Every problem's rows of (grad, previous grad, previous direction, step) are filled, zero where it did not
        ask: the passes run over all problems, and a zero gradient leaves a problem's direction zero."""
        index = torch.tensor(rows, device=self.pairs.device)
        grad = self._full(index, [a.grad for a in asks])
        before = self._full(index, [a.grad if a.first else cast(Tensor, a.previous_grad) for a in asks])
        step = self._full(index, [cast(Tensor, a.previous) * a.step if not a.first else torch.zeros_like(a.grad)
                                  for a in asks])
        starts = torch.zeros(len(self.count), dtype=torch.bool, device=grad.device)
        starts[index] = torch.tensor([a.first for a in asks], device=grad.device)
        self._store_pair(starts, any(a.first for a in asks), step, grad - before)
        d = self._two_loop(grad)[index]
        grad = grad[index]
        numbers = torch.stack([torch.linalg.vecdot(grad, d), d.abs().amax(-1), grad.abs().sum(-1)]).tolist()
        return [Directed(d[j], *values) for j, values in enumerate(zip(*numbers))]

    def _full(self, index: Tensor, rows: list[Tensor]) -> Tensor:
        """(problems, n): ``rows`` at ``index``, zero elsewhere."""
        out = self.pairs.new_zeros(len(self.count), self.pairs.shape[-1])
        return out.index_copy_(0, index, torch.stack(rows))

    def _store_pair(self, starts: Tensor, restarting: bool, s: Tensor, y: Tensor) -> None:
        """Clear the history of problems starting a run (``restarting``: any does); store the pair ``(s, y)`` of the
        others where ``y . s`` is positive enough (the oldest leaves a full window). Every pair that leaves a window is
        zeroed, so that the two-loop recursion can weight what lies outside a window by zero (torch.optim.LBFGS
        stores a pair whose ``y`` overflowed; its inf must not outlive the pair)."""
        ys = torch.linalg.vecdot(y, s)
        keep = ~starts & (ys > CURVATURE_MIN)
        if restarting:
            self.pairs[starts] = 0
        self.first.masked_fill_(starts, 0)
        self.count.masked_fill_(starts, 0)
        self.h_diag.masked_fill_(starts, 1.0)
        if bool((keep & (self.first + self.count >= self.pairs.shape[1])).any()):
            self._rewind()
        drop = keep & (self.count == self.history)
        everyone = torch.arange(len(keep), device=keep.device)
        self.pairs[everyone, self.first] = torch.where(drop[:, None, None], 0.0, self.pairs[everyone, self.first])
        self.first += drop
        self.count += keep & ~drop
        column = (self.first + self.count - 1).clamp_min(0)
        self.pairs[everyone, column] = torch.where(keep[:, None, None], torch.stack([s, y], dim=1),
                                                   self.pairs[everyone, column])
        self.rho[everyone, column] = torch.where(keep, 1 / ys, self.rho[everyone, column])
        self.h_diag.copy_(torch.where(keep, ys / torch.linalg.vecdot(y, y), self.h_diag))

    def _rewind(self) -> None:
        """Move every window back to the buffer's first columns (once every ``history`` stored pairs at most)."""
        for k, (first, count) in enumerate(zip(self.first.tolist(), self.count.tolist())):
            if first:
                self.pairs[k, :count] = self.pairs[k, first:first + count].clone()
                self.pairs[k, count:] = 0
                self.rho[k, :count] = self.rho[k, first:first + count].clone()
        self.first.zero_()

    def _two_loop(self, grad: Tensor) -> Tensor:
        """Every problem's L-BFGS direction ``-H grad``: the two-loop recursion over the columns that any window
        covers, each problem's pairs outside its window weighted zero."""
        begin, end = int(self.first.min()), int((self.first + self.count).max())
        columns = torch.arange(begin, end, device=grad.device)
        inside = (columns >= self.first[:, None]) & (columns < (self.first + self.count)[:, None])
        rho = self.rho[:, begin:end] * inside  # outside a window the pairs are zero (``_store_pair``): finite
        q, alpha = -grad, []
        for c in reversed(range(end - begin)):
            a = rho[:, c] * torch.linalg.vecdot(self.pairs[:, begin + c, 0], q)
            q = q.addcmul(a[:, None], self.pairs[:, begin + c, 1], value=-1)
            alpha.append(a)
        r = q * self.h_diag[:, None]
        for c, a in zip(range(end - begin), reversed(alpha)):
            b = rho[:, c] * torch.linalg.vecdot(self.pairs[:, begin + c, 1], r)
            r = r.addcmul((a - b)[:, None], self.pairs[:, begin + c, 0])
        return r


class LockStep:
    """Sequential solvers, one thread per problem, whose loss evaluations are gathered into batched passes.

    Each solver runs its own optimiser (torch.optim.LBFGS with its line search: a different number of
    evaluations per step for each problem) and calls ``request(variables)`` where it needs its loss and
    gradients. The threads take turns like coroutines: one runs until it requests (or ends), then the
    next; when all have requested, ``evaluate(rows, variables)`` computes every waiting problem's loss
    and gradients in one pass (``rows``: their indices). A solver's own arithmetic is untouched, so each
    problem takes the path it takes alone, up to the floating-point order of the batched pass.
    """

    def __init__(self, evaluate: Callable[[list[int], list[list[Tensor]]], list[tuple[Tensor, list[Tensor]]]]):
        self.evaluate = evaluate
        self._back = threading.Event()
        self._turns: list[threading.Event] = []
        self._asked: dict[int, list[Tensor]] = {}
        self._answers: dict[int, Any] = {}

    def run(self, solvers: list[Callable[[Callable[[list[Tensor]], tuple[Tensor, list[Tensor]]]], Any]]) -> list[Any]:
        """Each ``solver(request)``'s result, in order; the first error of any solver is raised."""
        results: list[Any] = [None] * len(solvers)
        errors: list[BaseException] = []
        self._turns = [threading.Event() for _ in solvers]
        threads = [threading.Thread(target=self._solve, args=(i, s, results, errors), daemon=True)
                   for i, s in enumerate(solvers)]
        for t in threads:
            t.start()
        live = list(range(len(solvers)))
        while live:
            for i in live:
                self._resume(i)
            live = [i for i in live if i in self._asked]
            if live:
                self._answers.update(zip(live, self._answer_all(live, [self._asked.pop(i) for i in live], errors)))
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def _resume(self, i: int) -> None:
        """Let solver ``i`` run until it requests an evaluation or ends."""
        self._back.clear()
        self._turns[i].set()
        self._back.wait()

    def _answer_all(self, rows: list[int], variables: list[list[Tensor]], errors: list[BaseException]) -> list:
        if errors:  # a solver failed: the others stop at this request
            return [errors[0]] * len(rows)
        try:
            return self.evaluate(rows, variables)
        except BaseException as exc:
            errors.append(exc)
            return [exc] * len(rows)

    def _solve(self, i: int, solver: Callable, results: list[Any], errors: list[BaseException]) -> None:
        def wait_turn() -> None:
            self._turns[i].wait()
            self._turns[i].clear()

        def request(variables: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
            self._asked[i] = variables
            self._back.set()
            wait_turn()
            answer = self._answers.pop(i)
            if isinstance(answer, BaseException):
                raise answer
            return answer

        wait_turn()
        try:
            results[i] = solver(request)
        except BaseException as exc:
            if exc not in errors:
                errors.append(exc)
        finally:
            self._back.set()
