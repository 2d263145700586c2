"""A report fit to cite (evaluator/results/provenance.py): no path of the machine that ran it, the digests of the
audit file, of the job file it reads beside it and of the model's initial state, and ``report --check``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from leakaudit.evaluator.cli import main

pytest.importorskip("nvflare")

JOB = Path(__file__).parent.parent / "examples" / "nvflare_job" / "job" / "app_site-1" / "config" / "config_fed_client.json"


def _audit(folder: Path) -> Path:
    """A tiny audit of the shipped NVFlare job, its job file beside it under job/."""
    (folder / "job").mkdir(parents=True)
    shutil.copy(JOB, folder / "job" / "client.json")
    audit = {"name": "cite", "seed": 0, "device": "cpu", "workers": 1,
             "data": {"dataset": "digits", "image_size": 8, "targets": 1, "batch_size": 1},
             "model": {"name": "mlp", "params": {"width": 16, "depth": 1}, "checkpoints": [0]},
             "protocol": {"name": "fedavg", "local_epochs": 1, "local_lr": 0.01},
             "defenses": [{"name": "nvflare_job", "params": {"path": "job/client.json"}}],
             "attacks": [{"name": "inverting_gradients", "params": {"iterations": 2}}],
             "utility": {"train_steps": 0}, "metrics": ["psnr", "mse"]}
    path = folder / "audit.yaml"
    path.write_text(yaml.safe_dump(audit, sort_keys=False))
    return path


def test_the_report_names_no_machine_path_and_its_digests_check(tmp_path, monkeypatch, capsys):
    audit = _audit(tmp_path / "team" / "audits")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the job file is found beside the audit file, not here
    out = elsewhere / "run"
    assert main(["run", str(audit), "--out", str(out)]) == 0
    page, summary = (out / "report.html").read_text(), (out / "summary.json").read_text()
    for text in (page, summary):
        assert str(tmp_path) not in text and str(audit.parent) not in text
    run = json.loads(summary)["run"]
    assert run["audit_file"] == "audit.yaml"
    digests = run["provenance"]["sha256"]
    assert sorted(digests) == ["audit file", "initial model state", "job/client.json"]
    assert all(len(d) == 64 for d in digests.values()) and run["provenance"]["leakaudit"]
    assert f"SHA-256 of job/client.json</dt><dd>{digests['job/client.json']}" in page
    capsys.readouterr()
    assert main(["report", str(out), "--check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["audit file", "job/client.json", "initial model state"]
    assert all(": matches (sha256 " in line for line in lines)
    (audit.parent / "job" / "client.json").write_text((audit.parent / "job" / "client.json").read_text() + "\n")
    assert main(["report", str(out), "--check"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("job/client.json: differs (sha256 ") and ", recorded " in lines[1]
    assert lines[0].startswith("audit file: matches") and lines[2].startswith("initial model state: matches")
    (audit.parent / "job" / "client.json").unlink()
    assert main(["report", str(out), "--check"]) == 2  # the audit no longer loads: one line naming the file
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nvflare_job(path=job/client.json)" in err and "No such file" in err


def test_a_model_digest_reads_every_entry_of_its_state_batchnorm_counters_included():
    """BatchNorm keeps a 0-dim counter (num_batches_tracked): it is digested like any tensor, and a changed running
    statistic changes the digest."""
    import torch
    from torch import nn

    from leakaudit.evaluator.results.provenance import state_digest

    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    before = state_digest(model)
    assert len(before) == 64 and before == state_digest(model)
    with torch.no_grad():
        model[1].running_mean += 1
    assert state_digest(model) != before
