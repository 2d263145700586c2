"""The shipped example audits, run from YAML at reduced budgets: batches, FedAvg, pruning with noise."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from leakaudit.evaluator.audit.budget import skipped_of
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.jobs import jobs_of
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.run.runner import run_audit
from leakaudit.evaluator.run.scenario import Scenario, check_scenario
from leakaudit.evaluator.zoo import datasets
from leakaudit.plugins.manager import load_registry

from conftest import ROOT


def _run(tmp_path, name: str, **changes) -> dict:
    audit = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    for dotted, value in changes.items():
        *path, last = dotted.split(".")
        node = audit
        for key in path:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(audit))
    return run_audit(load_audit(path), tmp_path / "out", progress=False)


def _psnr(summary, setting: str, attack: str) -> float:
    return summary.cell(setting, attack, 0).mean("psnr")


def _needs_absent_data(path) -> bool:
    """Whether a shipped file reads a torchvision set from a ``root:`` that this machine lacks, or Debian's
    Fashion-MNIST files where they are not installed."""
    data = yaml.safe_load(path.read_text())["data"] or {}
    root = data.get("root")
    if root is None and data.get("dataset") == "fashion_mnist":
        return not (datasets.FASHION_DIR / datasets.FASHION_FILES["train"][0]).is_file()
    return root is not None and not Path(root).is_dir()


@pytest.mark.slow
def test_every_shipped_audit_is_valid():
    """Each shipped file passes validation and the checks that need its data and built models; a file whose
    dataset is absent here fails with the one line that says where to put it (its stand-in run is below)."""
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(paths) >= 11
    for path in paths:
        if _needs_absent_data(path):
            with pytest.raises(ConfigError, match=r"data\.root: folder .* does not exist; put (MNIST/raw|"
                                                  r"cifar-10-batches-py)/ there|data\.dataset: fashion_mnist reads "
                                                  r"Debian's files .*; install them with: apt-get install"):
                load_audit(path)
            continue
        audit = load_audit(path)
        check_scenario(Scenario(audit))
        assert audit.settings and audit.attacks and jobs_of(audit), path


@pytest.mark.heavy
def test_table2_at_the_paper_shape_runs_on_an_offline_stand_in(tmp_path):
    """configs/bayes_table2_mnist_paper.yaml with its data and budgets reduced when full MNIST is absent: the
    20 MNIST images of the foolbox wheel stand in for it (said in the warning), so the file's steps 0 and 500,
    its clean training and its two-stage searches run here."""
    name = "bayes_table2_mnist_paper"
    audit = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    attacks = [audit["attacks"][0], audit["attacks"][3]]  # bayes and cos, at 5 steps and a budget of 15
    for attack in attacks:
        attack["params"]["iterations"], attack["tune"]["budget"] = 5, 15
    changes = {"defenses": audit["defenses"][:1], "attacks": attacks}
    if _needs_absent_data(ROOT / "configs" / f"{name}.yaml"):
        warnings.warn(f"{name}: full MNIST is absent; ran the offline stand-in (mnist_samples, 2 images)")
        changes["data"] = {"dataset": "mnist_samples", "image_size": 28, "targets": 2, "batch_size": 1,
                           "target_split": "train", "target_order": "first"}
    summary = _run(tmp_path, name, **changes)
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert sorted({r["checkpoint"] for r in rows}) == [0, 500] and all(r["epsilon"] is None for r in rows)
    utility = [json.loads(line) for line in (tmp_path / "out" / "utility.jsonl").read_text().splitlines()]
    assert all(u["train_defended"] is False and u["epsilon"] is None for u in utility)
    trials = [json.loads(line) for line in (tmp_path / "out" / "tuning.jsonl").read_text().splitlines()]
    # two attacks' searches of 15 trials at two steps, on the setting and on the reference added to calibrate it
    assert {t["stage"] for t in trials} == {"scan", "grid"} and len(trials) == 2 * 2 * 2 * 15
    assert all(s.budget == 15 and "scan priors.tv" in s.on_grid for s in summary.tuning)


@pytest.mark.slow
def test_batch_of_four_beats_the_random_guess(tmp_path):
    summary = _run(tmp_path, "batch4", **{"data.targets": 4})
    random_guess = summary.baselines["random"]
    cell = summary.cells[0]
    assert cell.targets == 1 and cell.mean("label_accuracy") == 1.0
    assert cell.mean("psnr") > random_guess["psnr"] + 4.0  # measured: 11.4 against 6.4 dB
    assert cell.mean("ssim") > random_guess["ssim"] + 0.15  # measured: 0.20 against 0.01


@pytest.mark.heavy
def test_fedavg_five_local_steps_beats_the_random_guess(tmp_path):
    summary = _run(tmp_path, "fedavg", **{"data.targets": 2, "attacks.0.params.iterations": 500})
    assert summary.cells[0].mean("psnr") > summary.baselines["random"]["psnr"] + 8.0
    assert summary.cells[0].mean("label_accuracy") == 1.0


@pytest.mark.heavy
def test_every_attack_leaks_less_as_pruning_noise_grows(tmp_path):
    summary = _run(tmp_path, "prune_noise", **{
        "data.targets": 2, "utility.train_steps": 0, "defenses": [
            {"name": "prune", "params": {"fraction": 0.02, "noise": "gaussian"}, "sweep": {"scale": [0.001, 1.0]}}],
        "attacks.0.params.iterations": 500})
    for attack in ("inverting_gradients", "dlg", "idlg"):
        weak = _psnr(summary, "prune(fraction=0.02,noise=gaussian,scale=0.001)", attack)
        strong = _psnr(summary, "prune(fraction=0.02,noise=gaussian,scale=1.0)", attack)
        assert weak > strong + 3.0, attack


@pytest.mark.heavy  # 20 s; DP-SGD's leakage, epsilon and accuracy against noise stay in tests/test_dpsgd.py
def test_dpsgd_curve_leaks_less_spends_less_and_learns_less_as_noise_grows(tmp_path):
    summary = _run(tmp_path, "dpsgd_curve", **{
        "data.targets": 2, "data.batch_size": 1, "model.checkpoints": [0],
        "utility": {"train_steps": 300, "batch_size": 4, "lr": 0.1, "delta": 1.0e-5},
        "defenses": [{"name": "none"},
                     {"name": "dpsgd", "params": {"max_grad_norm": 1.0}, "sweep": {"noise_multiplier": [0.003, 1.0]}}],
        "attacks": [{"name": "inverting_gradients", "params": {"iterations": 200}}]})
    worst = {w.setting: w for w in summary.worst_case}
    none = worst["none"]
    low, high = (worst[f"dpsgd(max_grad_norm=1.0,noise_multiplier={s})"] for s in (0.003, 1.0))
    assert none.mean("psnr") > high.mean("psnr") + 3.0 and low.mean("psnr") > high.mean("psnr") + 3.0
    assert none.epsilon is None and low.epsilon > high.epsilon > 0
    assert low.accuracy > high.accuracy + 0.1


def _reduced(audit: dict) -> dict:
    """The audit at a token budget: one target batch of at most 8 images (and at most as many clients), step 0
    (every attack runs there) and two training steps of at most 8 images, the first point of each sweep, two
    iterations, one restart or sample and 16 learning updates per attack, two tuning trials (four when a search scans)."""
    audit = {**audit, "workers": 1, "device": "cpu"}
    batch = min(audit["data"].get("batch_size", 1), 8)
    audit["data"] = {**audit["data"], "targets": batch, "batch_size": batch}
    audit["model"] = {**audit["model"], "checkpoints": [0]}
    protocol = audit.get("protocol")
    if isinstance(protocol, dict) and protocol.get("clients", 1) > batch:  # secure aggregation: one image each
        audit["protocol"] = protocol = {**protocol, "clients": batch}
    if isinstance(protocol, dict) and protocol.get("local_batch_size"):  # FedAvg's minibatches: half a client's images
        audit["protocol"] = {**protocol, "local_batch_size": min(protocol["local_batch_size"],
                                                                 max(1, batch // protocol.get("clients", 1) // 2))}
    utility = audit.get("utility", {})
    audit["utility"] = {**utility, "train_steps": 2, "batch_size": min(utility.get("batch_size", 8), 8)}
    for entry in audit["defenses"]:
        if isinstance(entry.get("clients"), list):  # the first number of clients, as the first of a sweep
            entry["clients"] = entry["clients"][:1]
        elif isinstance(entry.get("clients"), int):  # at most two clients, whose updates the targets fill
            entry["clients"] = min(entry["clients"], 2)
            audit["data"]["targets"] = max(audit["data"]["targets"], batch * entry["clients"])
        for member in [entry, *entry.get("chain", [])]:
            member["sweep"] = {k: v[:1] for k, v in member.get("sweep", {}).items()}
    registry = load_registry()
    for attack in audit.get("attacks", []):  # none listed: attacks: auto, at token budgets (token_auto_budgets)
        attack.pop("checkpoints", None)
        params = attack.setdefault("params", {})
        params.update(token_budget(registry.get("attack", attack["name"])))
        if "tune" in attack:
            attack["tune"] = {**attack["tune"], "budget": 2}
            if "scan" in attack["tune"]:  # two scan values around the file's own, and one grid trial
                scan = attack["tune"]["scan"]
                attack["tune"].update(budget=4, scan={**scan, "low": scan["low"], "high": scan["low"] * 10})
    return audit


#: The token budget of every attack parameter of that name.
TOKEN = {"iterations": 2, "restarts": 1, "samples": 1, "warmup": 0, "cg_iterations": 2, "updates": 16, "width": 16,
         "starts": 8, "steps": 2, "rounds": 1}


def token_budget(cls) -> dict:
    """The token budget of the parameters ``cls`` declares (SPEAR's draws stay enough to reach the reduced batch
    of 8, which its ``unsupported`` checks)."""
    return {k: v for k, v in TOKEN.items() if k in cls.params} | ({"samples": 1024} if cls.name == "spear" else {})


def token_auto_budgets(monkeypatch) -> None:
    """Every registered attack's ``attacks: auto`` budget cut to the token budget, for an audit that lists none."""
    for entry in load_registry().entries["attack"].values():
        if entry.obj.auto_params:
            monkeypatch.setattr(entry.obj, "auto_params", {device: {**params, **token_budget(entry.obj)}
                                                           for device, params in entry.obj.auto_params.items()})


STAND_INS = {"mnist": "mnist_samples", "cifar10": "cifar10_samples", "fashion_mnist": "fashion_mnist_samples"}  # the foolbox wheel's real images


def _offline(audit: dict, path) -> dict:
    """``audit`` with the offline stand-in (the foolbox wheel's images of that set) when its dataset is absent."""
    if _needs_absent_data(path):
        audit["data"] = {**audit["data"], "dataset": STAND_INS[audit["data"]["dataset"]], "root": None, "params": {}}
    return audit


#: The heaviest files even reduced: eight architectures' dense rank computations (about 4 minutes), Soteria's
#: per-step feature scores over its training, the Bayesian network at its full budget.
SLOW_TO_ANALYSE = {"linear_systems", "soteria_training", "bayesian_full_budget"}
# slow to run even reduced; covered by default by their twins (table1_resnet20, ats_training, cinet_cpu) and, for
# adaptive_defenses, by tests/test_adaptive_defenses.py's end-to-end audit; the Fashion-MNIST twins of
# realistic_cnn16 and realistic_clients by theirs and by realistic_mlp64_fashion
# flower_local_dp: the quickstart's model under a frontier search of up to 7 probes; its defense is checked by
# tests/test_flower_dp.py and tests/test_checks.py, a frontier run by configs/frontier.yaml's
SLOW_TO_RUN = {"adaptive_defenses", "table1_resnet20_paper", "ats_training_paper", "cinet_batch64",
               "text_dager_scale", "flower_local_dp", "realistic_cnn16_fashion", "realistic_clients_fashion"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(p.stem, marks=[pytest.mark.heavy] if p.stem in SLOW_TO_ANALYSE | SLOW_TO_RUN
                                                else [])
                                  for p in sorted((ROOT / "configs").glob("*.yaml"))])
def test_every_shipped_audit_runs_to_its_report(name, tmp_path, monkeypatch):
    """Each shipped file, reduced, runs from YAML to report.html and summary.json (no traceback after the work)."""
    import json

    source = ROOT / "configs" / f"{name}.yaml"
    token_auto_budgets(monkeypatch)
    audit = _offline(_reduced(yaml.safe_load(source.read_text())), source)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(audit))
    loaded = load_audit(path)
    summary = run_audit(loaded, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "report.html").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["cells"] == summary.to_json()["cells"]
    # every cell ran but those attacks: auto skipped once their step's verdict was settled (run.json says which)
    info = json.loads((tmp_path / "out" / "run.json").read_text())
    skipped = {tuple(s[:3]) for s in skipped_of(info)}
    assert {(c.setting, c.attack, c.checkpoint) for c in summary.cells} == {
        (j.setting.key, j.attack.key, j.checkpoint) for j in jobs_of(loaded)} - skipped
