"""Where an audit's items run: in this process or in spawned worker processes (one torch thread each; the
cores of idle workers shared among the items where a stage has fewer items than workers), how
many (``workers: auto``), and the progress bar and messages every executor shares (the Ray one too).

A spawned process runs the jobs of one audit: the pool's initializer builds its AuditWorker.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Protocol

import torch
from tqdm import tqdm

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.jobs import Cell
from leakaudit.evaluator.audit.types import Audit, DefenseSetting
from leakaudit.evaluator.results.rundir import RunError, RunFolder
from leakaudit.evaluator.run.scenario import Scenario, process_flags
from leakaudit.evaluator.run.worker import AuditWorker


def describe_item(item: Any) -> str:
    """Which work an item is, for a message: a setting, and for a cell its attack and step."""
    first = item.first if isinstance(item, Cell) else item
    if hasattr(first, "attack"):
        return f"{first.setting.key}, {first.attack.key}, step {first.checkpoint}"
    return getattr(first, "key", str(first))


def item_size(item: Any) -> int:
    """Jobs an item stands for (a cell: its jobs), for the progress bar."""
    return len(item.jobs) if isinstance(item, Cell) else 1


def progress_bar(items: list, desc: str, progress: bool) -> tqdm:
    """The bar over ``items``' jobs on stderr, whichever executor runs them."""
    return tqdm(total=sum(item_size(i) for i in items), desc=desc, unit="job", disable=not progress,
                file=sys.stderr, dynamic_ncols=True)


_PROCESS_WORKER: AuditWorker | None = None


def _init_process(audit_path: str, plugin_dirs: list[str], out_dir: str, threads: int, started,
                  target_offset: int = 0) -> None:
    """Build this process's AuditWorker (its targets from ``target_offset`` on: a frontier's fresh targets); on
    CUDA, the n-th process started takes the n-th visible GPU."""
    global _PROCESS_WORKER
    _die_with_parent()
    torch.set_num_threads(threads)
    audit = load_audit(audit_path, plugin_dirs).targets_from(target_offset)
    process_flags(audit)
    with started.get_lock():
        index, started.value = started.value, started.value + 1
    if audit.torch_device().type == "cuda":
        torch.cuda.set_device(index % torch.cuda.device_count())  # "cuda" now means this process's GPU
    _PROCESS_WORKER = AuditWorker(Scenario(audit), RunFolder(out_dir, audit))


def _die_with_parent() -> None:
    """End this worker as soon as the process that started it is gone (killed, even by SIGKILL), so no
    worker finishes a queued job or writes into the run folder after its run has stopped."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="leakaudit-parent-watch").start()


def _in_process(method: str, item: Any, threads: int = 1) -> Any:
    torch.set_num_threads(threads)
    return getattr(_PROCESS_WORKER, method)(item)


def threads_per_item(workers: int, items: int) -> int:
    """Torch threads each of an attack stage's items runs on: one, unless the stage leaves workers idle, whose cores
    its items then share (a lone Learning to Invert cell on 2 workers: both cores). Training keeps one thread, so
    that a resumed run trains its models bit for bit."""
    return max(1, workers // max(1, items))


class Pool(Protocol):
    """What the runner asks of an executor: ``WorkerPool`` on this machine, ``RayPool`` on a cluster."""

    @property
    def workers(self) -> int: ...

    @property
    def where(self) -> str | None: ...

    def __enter__(self) -> Pool: ...

    def __exit__(self, *exc: Any) -> None: ...

    def run(self, method: str, items: Iterable, desc: str, progress: bool,
            on_result: Callable[[Any, Any], None]) -> None: ...


class WorkerPool:
    """The run's worker processes: spawned on first use and shared by training, tuning and attacks, so a
    run pays for starting them (imports, the audit, the data) once. One worker runs jobs in this process."""

    def __init__(self, worker: AuditWorker, workers: int):
        self.worker, self.workers = worker, workers
        self.where: str | None = None  # run_info's description of the device
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is None:
            return
        if exc[0] is not None:  # a failed job, Ctrl-C or SIGTERM: stop the workers now, mid-job
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.terminate()
        self._pool.shutdown(wait=exc[0] is None, cancel_futures=exc[0] is not None)

    def _processes(self) -> ProcessPoolExecutor:
        if self._pool is None:
            audit = self.worker.scenario.audit
            ctx = multiprocessing.get_context("spawn")
            init = (str(audit.path), [str(d) for d in audit.plugins_dirs], str(self.worker.folder.path), 1,
                    ctx.Value("i", 0), audit.target_offset)
            self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_process, initargs=init)
        return self._pool

    def run(self, method: str, items: Iterable, desc: str, progress: bool,
            on_result: Callable[[Any, Any], None]) -> None:
        """``worker.<method>(item)`` for every item, results handed to ``on_result`` in order of completion."""
        items = list(items)
        if not items:
            return
        bar = progress_bar(items, desc, progress)
        if self.workers <= 1:
            for item in items:
                on_result(item, getattr(self.worker, method)(item))
                bar.update(item_size(item))
        else:
            pool = self._processes()
            futures: dict = {}
            threads = threads_per_item(self.workers, len(items)) if method == "attack" else 1
            try:
                for item in items:
                    futures[pool.submit(_in_process, method, item, threads)] = item
                for fut in as_completed(futures):
                    try:
                        result = fut.result()
                    except BrokenProcessPool:
                        raise _worker_lost(f"{desc} ({describe_item(futures[fut])})") from None
                    on_result(futures[fut], result)
                    bar.update(item_size(futures[fut]))
            except BrokenProcessPool:  # broken before any result came back (a worker failed to start)
                raise _worker_lost(desc) from None
            except BaseException:  # a failed job or Ctrl-C: stop queued jobs, keep the rows already written
                for fut in futures:
                    fut.cancel()
                raise
        bar.close()


def available_cores() -> int:
    """Cores this process may use: its CPU affinity where the OS reports one (Linux), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


#: Attack iterations (summed over a cell's targets) or training steps that pay for a worker process's start:
#: about 3 s of imports and loading, some 700 iterations of LeNet at 32 px on one core.
PROCESS_WORTH = 2000


def auto_workers(audit: Audit, pending: list) -> int:
    """``workers: auto`` on the CPU: one process per core, but no more than the pending items (settings to
    train, cells to attack) nor than their summed work pays starts for; one process's threads serve a single
    cell better than its targets cut across processes."""
    work: dict[Any, int] = {}
    for item in pending:
        if isinstance(item, DefenseSetting):
            work[item.key] = audit.utility.train_steps
        else:
            cls = audit.registry.get("attack", item.attack.name)
            params = {k: p.default for k, p in cls.params.items() if not p.required} | (item.params or item.attack.params)
            key = (item.setting.key, item.attack.key, item.checkpoint)
            work[key] = work.get(key, 0) + int(params.get("iterations", 1)) * int(params.get("restarts", 1))
    items = sum(w > 0 for w in work.values())
    return max(1, min(available_cores(), items, sum(work.values()) // PROCESS_WORTH))


def _worker_lost(during: str) -> RunError:
    """A worker process that died (the system's out-of-memory killer) or failed to start, as one line."""
    return RunError(f"a worker process died or failed to start during {during}: killed by the system (out of "
                    "memory?) or stopped by an error printed above; the rows already written are kept: rerun with "
                    "--resume, with a smaller max_problems: or fewer --workers")
