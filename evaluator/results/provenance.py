"""A run's provenance, fit to cite: SHA-256 digests of the audit file, of every file its defenses read (``Param.file``
parameters: an NVFlare job's client configuration) and of the model's initial state, with leakaudit's version, each
file named relative to the audit file's folder, so that no path of the machine that ran it is printed; ``check``
recomputes them (``leakaudit report DIR --check``).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leakaudit.evaluator.audit.materials import initial_model, load_data
from leakaudit.evaluator.audit.types import Audit
from leakaudit.plugins.components import ImageData
from leakaudit.plugins.text import TokenData

#: The keys of the audit file's and the model's digests in a provenance record (the others: files by their names).
AUDIT, MODEL = "audit file", "initial model state"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def state_digest(model: nn.Module) -> str:
    """SHA-256 of a model's state: each entry's name, dtype, shape and bytes, in the state dict's order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name} {value.dtype} {tuple(value.shape)}\n".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def files_read(audit: Audit) -> dict[str, Path]:
    """The audit file and each file a setting's defense reads (by its name as the audit file writes it, beside the
    audit file), where each is on this machine."""
    files = {AUDIT: audit.path}
    for setting in audit.settings:
        for name, params in setting.members:
            declared = audit.registry.get("defense", name).params
            for key, value in params.items():
                if key in declared and declared[key].file and isinstance(value, str):
                    files[value] = Path(setting.located(declared, {key: value})[key])
    return files


def initial_state(audit: Audit, data: ImageData | TokenData | None = None) -> str:
    """The digest of the audit's model at step 0, undefended (as every setting's starts, before a defense's layers)."""
    baseline = next(e.obj for e in audit.registry.entries["defense"].values() if e.obj.baseline)
    model = initial_model(audit, load_data(audit) if data is None else data, baseline(), None, torch.device("cpu"))
    return state_digest(model)


def record(audit: Audit, version: str, data: ImageData | TokenData | None = None) -> dict[str, Any]:
    """What run.json and summary.json keep: leakaudit's version and each digest by name."""
    return {"leakaudit": version, "sha256": {**{n: file_digest(p) for n, p in files_read(audit).items()},
                                             MODEL: initial_state(audit, data)}}


def public_run(run_info: dict[str, Any]) -> dict[str, Any]:
    """A run's record as a report may print it: the audit file by its name alone, no folder of this machine."""
    return {**run_info, **({"audit_file": Path(run_info["audit_file"]).name} if run_info.get("audit_file") else {})}


def check(audit: Audit, recorded: dict[str, Any]) -> list[tuple[str, bool]]:
    """One line per recorded digest, recomputed from the files as they are now (and the model rebuilt), and whether
    it matches."""
    files = files_read(audit)
    out = []
    for name, digest in recorded.get("sha256", {}).items():
        if name == MODEL:
            now = initial_state(audit)
        elif name == AUDIT:
            now = file_digest(audit.path)
        elif name not in files or not files[name].is_file():
            out.append((f"{name}: missing beside the audit file (recorded sha256 {digest[:16]}...)", False))
            continue
        else:
            now = file_digest(files[name])
        out.append((f"{name}: {'matches' if now == digest else 'differs'} (sha256 {now[:16]}..."
                    + ("" if now == digest else f", recorded {digest[:16]}...") + ")", now == digest))
    return out
