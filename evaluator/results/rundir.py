"""The run folder: its file names, the append-only JSONL and CSV tables, checkpoints and reconstructions.

Everything a run writes goes through here, so resume, the report and ``leakaudit analyse`` agree
on where each result lives. Rows are appended as they are produced; a kill loses at most the row
in flight.
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

import torch
import yaml

from leakaudit.evaluator.audit.config import load_audit, monitor_audit
from leakaudit.evaluator.audit.jobs import AttackJob
from leakaudit.evaluator.audit.seeds import derive_seed
from leakaudit.evaluator.audit.types import Audit, DefenseSetting
from leakaudit.evaluator.audit.yamlfile import AuditLoader, read_yaml
from leakaudit.evaluator.results.rows import Row
from leakaudit.plugins.spec import one_line


RESULTS = "results.jsonl"
RESULTS_CSV = "results.csv"
UTILITY = "utility.jsonl"
TUNING = "tuning.jsonl"
ARCHITECTURE = "architecture.json"
BASELINES = "baselines.json"
RUN_INFO = "run.json"
IDENTIFIABLE = "cache/identifiable.json"
DECOYS = "cache/decoys.pt"  # images of the target split that no update holds, for identifying batches
SUMMARY = "summary.json"
REPORT = "report.html"
AUDIT_COPY = "audit.yaml"
MONITOR = "monitor.json"  # a LeakMonitor's description of the training it audits (instead of audit.yaml)
VOCABULARY = "vocabulary.json"  # a monitored language model's token of each id, for the report's sentences
FRONTIER = "frontier.json"  # each frontier search's probes, in the order judged: the settings it added
FRESH = "fresh"  # the run folder, inside the audit's, of its frontier choices attacked again on fresh targets
CONFIRMED = "confirmed.json"  # each frontier choice's verdict on the fresh targets (or why it could not be judged)


class RunError(Exception):
    """The run cannot start or go on (one line, says what to do)."""


class AttackFailed(RunError):
    """An attack (a plugin's, often) raised while it ran: named with where it came from and the job, on one line.
    The rows already written are kept; ``leakaudit run`` exits with status 4."""


def _on_cpu(states: dict[int, dict]) -> dict[int, dict]:
    return {k: {n: t.cpu() for n, t in s.items()} for k, s in states.items()}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


#: Audit keys that change only how results are judged and reported, never a result: a run may be resumed,
#: or its report rebuilt, with them changed.
JUDGING_KEYS = ("workers", "executor", "verdict", "name", "leakage_metric")


def same_audit(first: str, second: str) -> bool:
    """Whether two audit files ask for the same results (they may differ in how the results are judged)."""
    def results_part(text: str) -> Any:
        raw = yaml.load(text, Loader=AuditLoader) or {}  # as load_audit reads it (1e-5 is a float)
        if not isinstance(raw, dict):
            return raw
        out = {k: v for k, v in raw.items() if k not in JUDGING_KEYS}
        if isinstance(out.get("defenses"), list):
            out["defenses"] = [{k: v for k, v in d.items() if k != "must_protect"} if isinstance(d, dict) else d
                               for d in out["defenses"]]
        return out
    return results_part(first) == results_part(second)


def slug(text: str) -> str:
    """A file-name-safe, unique name for a setting key."""
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", text)[:60]
    return f"{safe}-{derive_seed(text) % 16 ** 6:06x}"


class JsonlTable:
    """An append-only JSON-lines file that survives a kill mid-write (a torn last line is dropped)."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> list[dict[str, Any]]:
        """The rows; a torn last line (a kill mid-write) is dropped from the file, and rows glued together
        by a lost newline are split apart again."""
        if not self.path.exists():
            return []
        rows, lines = [], self.path.read_text().splitlines()
        repaired = False
        for i, line in enumerate(lines):
            found, torn = _objects(line)
            if torn and i != len(lines) - 1:
                raise RunError(f"{self.path}: line {i + 1} is not JSON; the file was edited by hand") from None
            rows.extend(found)
            repaired |= torn or len(found) > 1
        if repaired:
            self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def append(self, row: dict[str, Any]) -> None:
        """Append one row; a last line left without its newline (a partial write) is ended first."""
        with self.path.open("a+b") as fh:
            fh.seek(0, 2)
            if fh.tell():
                fh.seek(-1, 2)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
            fh.write((json.dumps(row) + "\n").encode())
            fh.flush()


def _objects(line: str) -> tuple[list[dict[str, Any]], bool]:
    """The JSON objects one line holds, and whether something after them is not JSON (a torn write)."""
    decoder, at = json.JSONDecoder(), 0
    found: list[dict[str, Any]] = []
    while at < len(line):
        try:
            value, at = decoder.raw_decode(line, at)
        except json.JSONDecodeError:
            return found, True
        if not isinstance(value, dict):
            return found, True
        found.append(value)
        while at < len(line) and line[at].isspace():
            at += 1
    return found, False


class CsvTable:
    """``results.csv``: rows appended as they land, rewritten in job order when the run ends."""

    def __init__(self, path: Path, metrics: list[str]):
        self.path = path
        self.columns = ["defense", "setting", "params", "attack", "checkpoint", "target", "epsilon", *metrics,
                        "seconds"]

    def _write(self, rows: Iterable[Row], mode: str) -> None:
        new = mode == "w" or not self.path.exists()
        with self.path.open(mode, newline="") as fh:
            writer = csv.DictWriter(fh, self.columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            for r in rows:
                writer.writerow({**r.to_json(), "params": json.dumps(r.params, sort_keys=True)})

    def append(self, row: Row) -> None:
        self._write([row], "a")

    def rewrite(self, rows: list[Row]) -> None:
        self._write(rows, "w")


class RunFolder:
    """One run's ``--out`` folder: where each table, checkpoint and reconstruction lives."""

    def __init__(self, path: str | Path, audit: Audit):
        self.path = Path(path)
        self.audit = audit
        self.results = JsonlTable(self.path / RESULTS)
        self.results_csv = CsvTable(self.path / RESULTS_CSV, audit.metrics)
        self.utility = JsonlTable(self.path / UTILITY)
        self.tuning = JsonlTable(self.path / TUNING)

    def check(self, resume: bool) -> None:
        """Refuse, writing nothing, a folder the run cannot use: a name too long, a file, a run there without
        ``resume``, or with ``resume`` a changed audit's run (``run`` asks before its estimate)."""
        saved = self.path / AUDIT_COPY
        too_long = next((part for part in self.path.parts if len(part.encode()) > 255), None)
        if too_long is not None:
            raise RunError(f"--out: {too_long[:40]}...: a folder name of {len(too_long.encode())} bytes, over the "
                           "255 a file system allows; choose a shorter --out")
        if self.path.exists() and not self.path.is_dir():
            raise RunError(f"--out: {self.path} is a file, not a folder; choose a folder")
        if not resume and (saved.exists() or self.results.path.exists()):
            raise RunError(f"--out: {self.path} already holds a run; pass --resume to continue it (a finished run "
                           f"only rewrites its report), or start over: choose another --out or delete {self.path}")
        if resume and saved.exists() and not same_audit(saved.read_text(), self.audit.text):
            raise RunError(f"--resume: {self.audit.path} differs from the audit first run in {self.path} "
                           f"(saved as {saved}); choose another --out")
        existing = next(p for p in (self.path.absolute(), *self.path.absolute().parents) if p.exists())
        why = "Not a directory" if not existing.is_dir() else None if os.access(existing, os.W_OK | os.X_OK) \
            else "Permission denied"  # as mkdir would say, before any work
        if why:
            raise RunError(f"--out: cannot write to {self.path}: {why}; choose a writable folder")

    def prepare(self, resume: bool) -> None:
        """The folder made, after ``check``, and the audit file saved in it."""
        self.check(resume)
        saved = self.path / AUDIT_COPY
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            saved.write_text(self.audit.text)
        except OSError as exc:
            raise RunError(f"--out: cannot write to {self.path}: {exc.strerror or exc}; choose a writable folder") from None

    def checkpoint_file(self, setting: DefenseSetting) -> Path:
        """The trained model's states at the audited steps, written by utility training."""
        return self.path / "cache" / "train" / f"{slug(setting.key)}.pt"

    def recon_file(self, job: AttackJob) -> Path:
        """One job's originals, reconstruction, labels and loss trace."""
        return (self.path / "cache" / "recon" / slug(job.setting.key)
                / f"{slug(job.attack.key)}-c{job.checkpoint}-t{job.target}.pt")

    def save_checkpoints(self, setting: DefenseSetting, states: dict[int, dict]) -> None:
        """Write a setting's checkpoints atomically (a kill leaves the old file or none)."""
        path = self.checkpoint_file(setting)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(_on_cpu(states), tmp)
        tmp.replace(path)

    def save_reconstruction(self, job: AttackJob, record: dict[str, Any]) -> None:
        path = self.recon_file(job)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(record, path)

    def write_outbox(self, kept: list[tuple[str, Any, Any]]) -> None:
        """Write what a remote worker's jobs kept for this folder (``Outbox.take``)."""
        for kind, key, value in kept:
            (self.save_checkpoints if kind == "checkpoints" else self.save_reconstruction)(key, value)

    def save_decoys(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """Keep the decoys a batch's identification test compares reconstructions with (pixels, labels, CPU)."""
        path = self.path / DECOYS
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"images": images.cpu(), "labels": labels.cpu()}, path)

    def has_decoys(self) -> bool:
        return (self.path / DECOYS).exists()

    def load_decoys(self) -> dict[str, torch.Tensor] | None:
        path = self.path / DECOYS
        return torch.load(path, weights_only=True) if path.exists() else None

    def rows(self) -> list[Row]:
        """results.jsonl's rows as records."""
        return [Row.from_json(r) for r in self.results.read()]

    def load_reconstruction(self, job: AttackJob) -> dict[str, Any] | None:
        path = self.recon_file(job)
        return torch.load(path, weights_only=True) if path.exists() else None

    def trained_settings(self) -> set[str]:
        """Keys of the settings whose utility row and checkpoints are both on disk."""
        files = {s.key: self.checkpoint_file(s) for s in self.audit.settings}
        return {r["setting"] for r in self.utility.read() if r["setting"] in files and files[r["setting"]].exists()}

    def read_json(self, name: str) -> Any | None:
        return read_json(self.path / name)

    def write_json(self, name: str, value: Any) -> None:
        tmp = self.path / f"{name}.tmp"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(value, indent=2))
        tmp.replace(self.path / name)

    def start_session(self, info: dict[str, Any]) -> None:
        """Record in run.json that a run (or a resume) of this folder starts: its versions, device and time.
        A resume on another kind of device, or with other kernels, would mix numbers: refused."""
        saved = self.read_json(RUN_INFO) or {"sessions": []}
        for key, what in (("device_type", "device"), ("deterministic", "deterministic kernels")):
            if key in saved and key in info and saved[key] != info[key]:
                raise RunError(f"--resume: {self.path} was run with {what} {saved[key]} and this session has "
                               f"{info[key]}; its rows would mix numbers: resume where it started (device: in the "
                               "audit file), or choose another --out")
        saved.update(info)
        saved["sessions"].append({"started": _now(), "finished": None, "seconds": None,
                                  "versions": info.get("versions"), "device": info.get("device")})
        self.write_json(RUN_INFO, saved)

    def finish_session(self, seconds: float) -> dict[str, Any]:
        """Record that the current session finished after ``seconds``; returns run.json's contents."""
        saved = self.read_json(RUN_INFO)
        assert saved is not None, "start_session wrote run.json"
        saved["sessions"][-1].update(finished=_now(), seconds=round(seconds, 1))
        self.write_json(RUN_INFO, saved)
        return saved

    def write_text(self, name: str, text: str) -> Path:
        (self.path / name).write_text(text)
        return self.path / name


class Outbox(RunFolder):
    """The run folder as a remote worker sees it (a Ray task, with no shared filesystem): what a job would
    write, checkpoints and reconstructions, is kept and sent back with its result, for the driver, the run
    folder's one writer, to write (``RunFolder.write_outbox``). Nothing is written here."""

    def __init__(self, audit: Audit) -> None:
        super().__init__(Path("(remote)"), audit)
        self.kept: list[tuple[str, Any, Any]] = []

    def save_checkpoints(self, setting: DefenseSetting, states: dict[int, dict]) -> None:
        self.kept.append(("checkpoints", setting, _on_cpu(states)))

    def save_reconstruction(self, job: AttackJob, record: dict[str, Any]) -> None:
        self.kept.append(("reconstruction", job, record))

    def take(self) -> list[tuple[str, Any, Any]]:
        """What the jobs since the last call would have written, emptied."""
        kept, self.kept = self.kept, []
        return kept


MONITOR_JUDGING = ("name", "leakage_metric", "verdict")  # what --config may set on a LeakMonitor's folder


def monitor_judging(config: Path, folder: Path) -> dict[str, Any]:
    """What ``report --config`` changes in how a LeakMonitor's folder is judged: its name, leakage_metric and
    verdict: section; any other key is refused in one line (the monitor's training is not an audit file's)."""
    _, raw = read_yaml(config)
    if not isinstance(raw, dict):
        raise RunError(f"--config: {config}: expected a mapping with {', '.join(MONITOR_JUDGING)}")
    other = [k for k in raw if k not in MONITOR_JUDGING]
    if other:
        raise RunError(f"--config: {config}: {other[0]}: {folder} was written by a LeakMonitor, judged again only by "
                       f"{', '.join(MONITOR_JUDGING)}; leave {other[0]} out")
    return raw


def read_json(path: Path) -> Any | None:
    """A run folder's JSON file (None where it is absent); a RunError, one line, where it is damaged."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunError(f"{path}: damaged ({one_line(exc)}); the run folder was edited or cut off while "
                       "written: restore the file, or start again in a new --out") from None


def saved_audit(path: Path, config: str | None = None, plugins_dirs: Iterable[str] = ()) -> Audit:
    """The audit a run folder was made with: ``config`` when given (it may differ only in how results are
    judged), else the original file while it is unchanged (its factories resolve beside it), else the copy.
    A LeakMonitor's folder has no audit file: its ``monitor.json`` describes the training it audited."""
    if not path.is_dir():
        raise RunError(f"{path}: no such folder; give a run's --out folder")
    if (path / MONITOR).is_file():
        described = read_json(path / MONITOR)
        assert described is not None, "the file exists"
        if config is not None:
            described = {**described, **monitor_judging(Path(config), path)}
        return monitor_audit(described, path / MONITOR, list(plugins_dirs))
    saved = path / AUDIT_COPY
    if not saved.is_file():
        raise RunError(f"{path}: not a leakaudit run folder (no {AUDIT_COPY}); give a run's --out folder")
    text = saved.read_text()
    if config is not None:
        audit = load_audit(config, list(plugins_dirs))
        if not same_audit(text, audit.text):
            raise RunError(f"--config: {config} asks for other results than the run in {path} (saved as {saved}); "
                           "only its name, leakage_metric, verdict: section, workers and must_protect marks may "
                           "differ")
        return audit
    info = read_json(path / RUN_INFO) or {}
    original = Path(info.get("audit_file", ""))
    if info.get("audit_file") and original.is_file() and original.read_text() == text:
        return load_audit(original, list(plugins_dirs))
    return load_audit(saved, list(plugins_dirs))
