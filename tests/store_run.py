"""Rewrite the stored copy that tests/test_stored_run.py compares with (tests/data/stored_run/), after a change
meant to alter results; say why in the commit. The test itself only compares, so it can always fail.

    python tests/store_run.py
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_stored_run import AUDIT, FILES, STORED  # noqa: E402  (the audit the test runs)

from leakaudit.evaluator.audit.config import load_audit  # noqa: E402
from leakaudit.evaluator.run.runner import run_audit  # noqa: E402


def main() -> None:
    torch.manual_seed(0)  # as the test session's fixtures set it
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "audit.yaml"
        path.write_text(yaml.safe_dump(AUDIT, sort_keys=False))
        run_audit(load_audit(path), Path(tmp) / "out", progress=False)
        STORED.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(Path(tmp) / "out" / name, STORED / name)
    print(f"stored: {', '.join(str(STORED / name) for name in FILES)}")


if __name__ == "__main__":
    main()
