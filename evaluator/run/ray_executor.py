"""Audits past one machine: every cell of an audit as a Ray task (``executor: ray``; install ``leakaudit[ray]``).

The driver, the process that runs ``leakaudit run``, stays the run folder's one writer. Each task returns its
result with what its jobs would have written (``rundir.Outbox``). The driver then writes the files and the
rows as the tasks finish, so ``--resume`` works as it does locally. A task whose worker process or node dies
is rerun by Ray (``max_retries``); it wrote nothing, so nothing is lost and nothing is written twice. The
audit's text, the data and the checkpoints of utility training reach the workers through Ray's object
store: no shared filesystem is assumed. Factories, plugin folders and weight files the audit names must be
on every node (Ray's ``runtime_env``, or one container image). A cell's numbers depend only on the audit's
seed and the cell (``scenario.round_generators``), never on the node or the order it ran in.
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.jobs import Cell
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.results.rundir import Outbox, RunError
from leakaudit.evaluator.run.executors import describe_item, item_size, progress_bar
from leakaudit.evaluator.run.scenario import Scenario, process_flags
from leakaudit.plugins.spec import PluginError, one_line

try:
    import ray
except ImportError as exc:  # pragma: no cover - config.check_executor says it before any work
    raise ImportError("executor: ray needs Ray: pip install 'leakaudit[ray]'") from exc

_WORKER: tuple[str, Any] | None = None  # this Ray worker process's AuditWorker, and its audit's key


def run_job(spec: dict[str, Any], data: list, method: str, item: Any, states: list | None) -> tuple[Any, list]:
    """One cell (or training run) on a Ray worker: ``AuditWorker.<method>(item)``, and what it would write.
    ``data`` and ``states`` hold object references, fetched once per worker process and setting."""
    global _WORKER
    if _WORKER is None or _WORKER[0] != spec["key"]:
        torch.set_num_threads(spec["threads"])
        audit = load_audit(spec["path"], spec["plugins_dirs"], text=spec["text"]).targets_from(spec["target_offset"])
        process_flags(audit)
        scenario = Scenario(audit)
        scenario.__dict__["data"] = ray.get(data[0])  # the driver's data, not this node's files
        _WORKER = (spec["key"], spec["worker_type"](scenario, Outbox(audit)))
    worker = _WORKER[1]
    if states is not None:
        worker.provide_states(item.first.setting.key, lambda: ray.get(states[0]))
    result = getattr(worker, method)(item)
    return result, worker.folder.take()


def _unreachable(address: str) -> str | None:
    """Why nothing listens at a ``host:port`` (or ``ray://host:port``) address, found by one TCP connection with a
    5 s timeout; None where something answers or the address names no port ("auto", "local")."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        return f"nothing answers at {host}:{port} ({exc.strerror or type(exc).__name__})"
    return None


@contextmanager
def _stderr_kept_back(active: bool) -> Iterator[bytearray]:
    """Hold back what is written to file descriptor 2 inside the block (Ray's C++ core writes there, past Python's
    sys.stderr), and give it to the caller, who shows it or drops it; only while joining an existing cluster,
    whose daemons are not this process's children and so cannot inherit the redirection."""
    kept = bytearray()
    if not active:
        yield kept
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield kept
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept.extend(held.read())


class RayPool:
    """``WorkerPool``'s interface on a Ray cluster: joined (or started) on entering, each item a task."""

    def __init__(self, worker: Any) -> None:
        """``worker``: the driver's ``worker.AuditWorker``; each Ray worker process builds one of its type."""
        self.worker = worker
        self.executor = worker.scenario.audit.executor
        self._started = False
        self._states: dict[str, Any] = {}

    def __enter__(self) -> "RayPool":
        ex, audit = self.executor, self.worker.scenario.audit
        if not ray.is_initialized():
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network but the cluster's own
            address = ex.address or os.environ.get("RAY_ADDRESS", "")

            def cannot_join(why: str) -> RunError:
                return RunError(f"executor: cannot join the Ray cluster at {ex.address or 'RAY_ADDRESS'}: {why}; "
                                "start it (ray start --head) or fix executor.address")

            refused = _unreachable(address)
            if refused:  # said at once: Ray's own client would retry a closed port for minutes
                raise cannot_join(refused)
            try:
                with _stderr_kept_back(bool(address)) as kept:  # Ray's core retries aloud, a line a second
                    ray.init(address=ex.address, include_dashboard=False, logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, TimeoutError) as exc:
                raise cannot_join(one_line(exc)[:300]) from None
            if kept:  # joined: what Ray said on the way is worth reading
                os.write(2, kept)
            self._started = True
        resources = ray.cluster_resources()
        slots = resources.get("CPU", 1) // ex.num_cpus
        if ex.num_gpus:
            slots = min(slots, resources.get("GPU", 0) // ex.num_gpus)
        if slots < 1:
            raise RunError(f"executor: the Ray cluster has {resources.get('CPU', 0):g} CPUs and "
                           f"{resources.get('GPU', 0):g} GPUs, too few for one task of num_cpus {ex.num_cpus:g}, "
                           f"num_gpus {ex.num_gpus:g}")
        self.workers = int(slots)  # cells are cut for this many tasks at once, as for as many local processes
        self.where = (f"ray: {int(resources.get('CPU', 0))} CPUs, {int(resources.get('GPU', 0))} GPUs on "
                      f"{len(ray.nodes())} node(s), {self.workers} task(s) at once")
        offset = audit.target_offset  # a frontier confirmation's fresh targets
        self._spec = {"key": hashlib.sha256(f"{audit.path}\n{audit.text}\n{offset}".encode()).hexdigest(),
                      "path": str(audit.path), "text": audit.text, "plugins_dirs": [str(d) for d in audit.plugins_dirs],
                      "target_offset": offset,
                      "threads": max(1, int(ex.num_cpus)), "worker_type": type(self.worker)}
        self._data = ray.put(self.worker.scenario.data)
        self._remote = ray.remote(run_job).options(num_cpus=ex.num_cpus, num_gpus=ex.num_gpus,
                                                   max_retries=ex.max_retries, retry_exceptions=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._states.clear()
        if self._started:
            ray.shutdown()

    def run(self, method: str, items: Iterable, desc: str, progress: bool,
            on_result: Callable[[Any, Any], None]) -> None:
        """``worker.<method>(item)`` for every item as Ray tasks; results written and handed to ``on_result``
        here, in order of completion."""
        items = list(items)
        if not items:
            return
        bar = progress_bar(items, desc, progress)
        pending = {self._submit(method, item): item for item in items}
        try:
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                item = pending.pop(ref)
                result, kept = self._result(ref, desc, item)
                self.worker.folder.write_outbox(kept)
                on_result(item, result)
                bar.update(item_size(item))
        except BaseException:  # a failed task or Ctrl-C: stop the others, keep the rows already written
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        bar.close()

    def _submit(self, method: str, item: Any) -> Any:
        states = None
        if isinstance(item, Cell):  # tuning and attacks start from a trained checkpoint
            setting = item.first.setting
            if setting.key not in self._states:  # one setting's at a time (the cells come setting by setting)
                self._states = {setting.key: ray.put(torch.load(self.worker.folder.checkpoint_file(setting),
                                                                map_location="cpu", weights_only=True))}
            states = [self._states[setting.key]]
        return self._remote.remote(self._spec, [self._data], method, item, states)

    @staticmethod
    def _result(ref: Any, desc: str, item: Any) -> tuple[Any, list]:
        """A task's result; a failure as one line naming the work, as a local run names it."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, (ConfigError, PluginError, RunError)):
                raise cause from None
            raise RunError(f"{desc} ({describe_item(item)}) failed on a Ray worker: {type(cause).__name__}: {cause}; "
                           "the rows already written are kept: fix it and rerun with --resume") from cause
        except ray.exceptions.RayError as exc:
            raise RunError(f"{desc} ({describe_item(item)}): a Ray worker or node died and the task's retries ran out "
                           f"({type(exc).__name__}); the rows already written are kept: rerun with --resume") from None
