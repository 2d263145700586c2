"""The runner: every output written, rows appended as produced, resume after a kill, same file same numbers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.jobs import jobs_of
from leakaudit.evaluator.results.rows import Row
from leakaudit.evaluator.run import worker as run_worker
from leakaudit.evaluator.run.runner import RunError, run_audit

from conftest import LEAKAUDIT, small_audit

OUTPUTS = ("results.jsonl", "results.csv", "summary.json", "utility.jsonl", "report.html", "privacy_utility.png",
           "reconstructions_step0.png", "worst_images.png", "run.json", "baselines.json", "audit.yaml")


def _rows(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _numbers(rows):
    return sorted((r["setting"], r["attack"], r["checkpoint"], r["target"], r["psnr"], r["ssim"]) for r in rows)


@pytest.mark.slow
def test_small_audit_writes_every_output(write_audit, tmp_path):
    audit = load_audit(write_audit(small_audit(model={"name": "lenet_zhu", "checkpoints": [0, 3]})))
    summary = run_audit(audit, tmp_path / "out", progress=False)
    out = tmp_path / "out"
    for name in (*OUTPUTS, "leakage_by_step.png", "reconstructions_step3.png"):
        assert (out / name).stat().st_size > 0, name
    rows = _rows(out)
    assert len(rows) == 2 * 2 * 2  # settings x checkpoints x targets
    for key in ("defense", "params", "attack", "checkpoint", "target", "psnr", "ssim", "mse", "label_accuracy",
                "seconds"):
        assert key in rows[0]
    header = (out / "results.csv").read_text().splitlines()[0]
    assert header == "defense,setting,params,attack,checkpoint,target,epsilon,psnr,ssim,mse,label_accuracy,seconds"
    assert {w.setting for w in summary.worst_case} == {"none", "gaussian(sigma=0.1)"}
    assert all(0 <= u.accuracy <= 1 for u in summary.utility.values())
    html = (out / "report.html").read_text()
    # privacy-utility, leakage by step, the worst images and a grid per checkpoint; no epsilon plot without dpsgd
    assert html.count("data:image/png;base64,") == 5 and "name: small" in html


@pytest.mark.slow
def test_same_file_same_numbers(write_audit, tmp_path):
    audit = load_audit(write_audit(small_audit()))
    run_audit(audit, tmp_path / "a", progress=False)
    run_audit(audit, tmp_path / "b", progress=False)
    assert _numbers(_rows(tmp_path / "a")) == _numbers(_rows(tmp_path / "b"))


@pytest.mark.slow
def test_worker_processes_give_the_same_numbers(write_audit, tmp_path):
    audit = load_audit(write_audit(small_audit()))
    run_audit(audit, tmp_path / "one", progress=False, workers=1)
    run_audit(audit, tmp_path / "two", progress=False, workers=2)
    one, two = _numbers(_rows(tmp_path / "one")), _numbers(_rows(tmp_path / "two"))
    assert [r[:4] for r in one] == [r[:4] for r in two]
    assert all(a[4] == pytest.approx(b[4], abs=1e-3) for a, b in zip(one, two))


def test_existing_results_are_never_overwritten(write_audit, tmp_path):
    audit = load_audit(write_audit(small_audit(defenses=[{"name": "none"}])))
    run_audit(audit, tmp_path / "out", progress=False)
    with pytest.raises(RunError) as refused:
        run_audit(audit, tmp_path / "out", progress=False)
    out = tmp_path / "out"  # the one line says both ways on: resume, or start over
    assert str(refused.value) == (f"--out: {out} already holds a run; pass --resume to continue it (a finished run "
                                  f"only rewrites its report), or start over: choose another --out or delete {out}")


def test_a_run_killed_before_its_first_row_is_not_restarted_over_with_an_edited_audit(write_audit, tmp_path):
    """The folder holds the first audit's training: a rerun without --resume is refused, and with --resume
    an edited audit is refused, so old checkpoints are never reused for new settings."""
    out = tmp_path / "out"
    run_audit(load_audit(write_audit(small_audit(defenses=[{"name": "none"}]))), out, progress=False)
    (out / "results.jsonl").unlink()  # killed after training, before the first row
    edited = load_audit(write_audit(small_audit(defenses=[{"name": "none"}], utility={"train_steps": 3, "lr": 0.5}),
                                    name="edited.yaml"))
    with pytest.raises(RunError, match=f"--out: {out} already holds a run; pass --resume"):
        run_audit(edited, out, progress=False)
    with pytest.raises(RunError, match="differs from the audit first run"):
        run_audit(edited, out, resume=True, progress=False)


def test_out_that_is_a_file_or_read_only_is_one_line(write_audit, tmp_path):
    audit = load_audit(write_audit(small_audit(defenses=[{"name": "none"}])))
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunError, match="is a file, not a folder"):
        run_audit(audit, tmp_path / "file", progress=False)
    with pytest.raises(RunError, match="cannot write to .*file/out: Not a directory; choose a writable folder"):
        run_audit(audit, tmp_path / "file" / "out", progress=False)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root may write anywhere
            with pytest.raises(RunError, match="cannot write to .*: Permission denied; choose a writable folder"):
                run_audit(audit, locked / "out", progress=False)
    finally:
        locked.chmod(0o700)


def test_a_row_left_without_its_newline_is_ended_before_the_next(tmp_path):
    from leakaudit.evaluator.results.rundir import JsonlTable

    table = JsonlTable(tmp_path / "t.jsonl")
    table.path.write_text('{"a": 1}\n{"a": 2}')  # partial write: the last row lost its newline
    table.append({"a": 3})
    assert table.read() == [{"a": 1}, {"a": 2}, {"a": 3}]
    table.path.write_text('{"a": 1}\n{"a": 2}{"a": 3}\n{"a": 4}\n{"a": ')  # glued rows (older runs) and a torn end
    assert table.read() == [{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}]
    assert table.path.read_text() == "".join(f'{{"a": {i}}}\n' for i in range(1, 5))


@pytest.mark.slow
def test_resume_recomputes_only_missing_rows(write_audit, tmp_path, monkeypatch):
    audit = load_audit(write_audit(small_audit()))
    out = tmp_path / "out"
    run_audit(audit, out, progress=False)
    full = _rows(out)
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])  # killed mid-write
    calls = []
    real = run_worker.AuditWorker.attack
    monkeypatch.setattr(run_worker.AuditWorker, "attack",
                        lambda self, cell: calls.extend(j.key for j in cell.jobs) or real(self, cell))
    run_audit(audit, out, resume=True, progress=False)
    assert len(calls) == len(full) - 2
    assert _numbers(_rows(out)) == _numbers(full)


def test_resume_says_in_one_line_what_it_reused(write_audit, tmp_path, capsys):
    audit = load_audit(write_audit(small_audit(defenses=[{"name": "none"}])))
    out = tmp_path / "out"
    run_audit(audit, out, resume=True, progress=False)  # --resume on an empty folder: a fresh start
    assert capsys.readouterr().err.splitlines() == [f"resuming {out}: nothing to reuse there; the audit runs from "
                                                    "the start"]
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text(lines[0] + "\n")
    run_audit(audit, out, resume=True, progress=False)
    assert capsys.readouterr().err.splitlines() == [
        f"resuming {out}: reused 1 of 1 trained setting, 0 tuning trials and 1 of 2 attack jobs' rows; left: 0 "
        "settings to train and at most 1 attack job"]


@pytest.mark.slow
def test_resume_refuses_a_changed_audit(write_audit, tmp_path):
    out = tmp_path / "out"
    run_audit(load_audit(write_audit(small_audit(defenses=[{"name": "none"}]))), out, progress=False)
    changed = load_audit(write_audit(small_audit(defenses=[{"name": "none"}], seed=1), name="other.yaml"))
    with pytest.raises(RunError, match="differs from the audit first run"):
        run_audit(changed, out, resume=True, progress=False)


# slow: a kill and resume through the CLI; test_a_worker_killed_by_the_system_is_one_line_and_resumable
# covers resuming by default
@pytest.mark.heavy
def test_killed_run_resumes_from_the_command_line(write_audit, tmp_path):
    audit = small_audit(attacks=[{"name": "inverting_gradients", "params": {"iterations": 150}}],
                        data={"dataset": "digits", "image_size": 16, "targets": 3, "batch_size": 1})
    path = write_audit(audit)
    out = tmp_path / "out"
    cmd = [*LEAKAUDIT, "run", str(path), "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "results.jsonl").exists() and _rows(out)):
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    done_before = _rows(out)
    assert 1 <= len(done_before) < 6
    subprocess.run([*cmd, "--resume"], check=True, capture_output=True)
    after = _rows(out)
    assert len(after) == 6
    assert after[:len(done_before)] == done_before  # finished rows kept, not recomputed
    fresh = tmp_path / "fresh"
    subprocess.run([*LEAKAUDIT, "run", str(path), "--out", str(fresh), "--no-progress"], check=True,
                   capture_output=True)
    assert _numbers(after) == _numbers(_rows(fresh))


def test_summary_leaves_out_non_finite_scores_and_says_so(write_audit):
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.results.summary import summarise

    audit = load_audit(write_audit(small_audit()))
    row = {"defense": "none", "setting": "none", "params": {}, "attack": "inverting_gradients", "checkpoint": 0,
           "seconds": 1.0, "ssim": 0.5, "mse": 0.1, "label_accuracy": 1.0}
    rows = [{**row, "target": 0, "psnr": 20.0}, {**row, "target": 1, "psnr": float("nan")}]
    notes: list[str] = []
    summary = summarise(audit, [Row.from_json(r) for r in rows], [], notes)
    assert summary.cells[0].mean("psnr") == 20.0 and summary.cells[0].scores["psnr"].std == 0.0
    assert notes == ["none, inverting_gradients, step 0: 1 of 2 images have a non-finite psnr "
                     "(the model or the reconstruction diverged); the cell leaves them out"]


def test_summary_sets_the_strongest_adaptive_attack_beside_the_strongest_naive_one(write_audit):
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.results.summary import summarise
    from leakaudit.evaluator.results.types import NaiveVsAdaptive

    attacks = [{"name": "inverting_gradients", "label": "ig"}, {"name": "dlg", "label": "dlg"},
               {"name": "inverting_gradients", "label": "ig_drop", "params": {"drop_defended": True}},
               {"name": "bayes", "label": "tuned", "role": "naive"}]
    audit = load_audit(write_audit(small_audit(attacks=attacks)))
    assert [a.role for a in audit.attacks] == ["naive", "naive", "adaptive", "naive"]
    row = {"defense": "none", "setting": "none", "params": {}, "checkpoint": 0, "seconds": 1.0, "target": 0}
    scores = {"ig": 12.0, "dlg": 14.5, "ig_drop": 21.0, "tuned": 13.0}
    rows = [{**row, "attack": a, "psnr": v} for a, v in scores.items()]
    rows.append({**row, "setting": "gaussian(sigma=0.1)", "defense": "gaussian", "attack": "ig", "psnr": 9.0})
    (line,) = summarise(audit, [Row.from_json(r) for r in rows], [], []).naive_vs_adaptive
    assert line == NaiveVsAdaptive(defense="none", setting="none", checkpoint=0, metric="psnr", accuracy=None,
                                   naive_attack="dlg", naive_score=14.5, adaptive_attack="ig_drop",
                                   adaptive_score=21.0, gap=6.5)


def test_a_lower_is_better_leakage_metric_picks_the_lowest_score(write_audit):
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.results.summary import summarise

    attacks = [{"name": "inverting_gradients", "label": "ig"},
               {"name": "inverting_gradients", "label": "ig_drop", "params": {"drop_defended": True}}]
    audit = load_audit(write_audit(small_audit(attacks=attacks, metrics=["mse", "ssim"])))
    assert audit.leakage_metric == "mse"
    row = {"defense": "none", "setting": "none", "params": {}, "checkpoint": 0, "seconds": 1.0, "target": 0,
           "ssim": 0.5}
    rows = [{**row, "attack": "ig", "mse": 0.02}, {**row, "attack": "ig_drop", "mse": 0.05}]
    summary = summarise(audit, [Row.from_json(r) for r in rows], [], [])
    assert summary.worst_case[0].attack == "ig" and summary.worst_case[0].mean("mse") == 0.02
    (line,) = summary.naive_vs_adaptive
    assert line.gap == pytest.approx(-0.03)  # the adaptive attack leaked less: a negative gap


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _running_with_two_workers(write_audit, tmp_path) -> tuple[subprocess.Popen, list[int]]:
    """A long run started from the command line, once its two workers are up and training is done."""
    audit = small_audit(workers=2, attacks=[{"name": "inverting_gradients", "params": {"iterations": 3000}}],
                        data={"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 1})
    out = tmp_path / "out"
    proc = subprocess.Popen([*LEAKAUDIT, "run", str(write_audit(audit)), "--out", str(out), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    workers: list[int] = []
    while time.time() < deadline and not ((out / "utility.jsonl").exists() and len(workers) >= 2):
        workers = [c for c in _children(proc.pid) if "spawn_main" in (Path("/proc") / str(c) / "cmdline").read_text()]
        time.sleep(0.1)
    assert len(workers) >= 2, "the run did not start its two workers"
    return proc, workers


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.heavy)])
def test_workers_do_not_outlive_a_killed_run(write_audit, tmp_path, sig):
    proc, workers = _running_with_two_workers(write_audit, tmp_path)
    proc.send_signal(sig)
    proc.wait(timeout=30)
    deadline = time.time() + 10
    while time.time() < deadline and any(map(_alive, workers)):
        time.sleep(0.1)
    assert not any(map(_alive, workers)), f"workers {workers} outlived their parent"
    if sig == signal.SIGTERM:
        assert proc.returncode == 130 and "rerun with --resume" in proc.stderr.read()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_a_worker_killed_by_the_system_is_one_line_and_resumable(write_audit, tmp_path):
    """The out-of-memory killer takes a worker: one line that says which work and what to do, no traceback."""
    proc, workers = _running_with_two_workers(write_audit, tmp_path)
    time.sleep(1.0)  # into the attacks
    os.kill(workers[0], signal.SIGKILL)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "leakaudit: error: a worker process died or failed to start during attacks (")
    assert err.strip().endswith("rerun with --resume, with a smaller max_problems: or fewer --workers")


@pytest.mark.slow
def test_resume_allows_what_only_judges_and_refuses_another_device(write_audit, tmp_path):
    """A changed name, leakage_metric, verdict or must_protect changes no row: resume goes on. A resume on
    another kind of device would mix its numbers with the first session's: refused in one line."""
    out = tmp_path / "out"
    first = small_audit(attacks=[{"name": "inverting_gradients", "params": {"iterations": 5}}])
    run_audit(load_audit(write_audit(first)), out, progress=False)
    judged = {**first, "name": "renamed", "leakage_metric": "ssim", "verdict": {"margin": 0.1, "bootstrap": 500},
              "defenses": [{"name": "none"}, {"name": "gaussian", "params": {"sigma": 0.1}, "must_protect": True}]}
    summary = run_audit(load_audit(write_audit(judged, "judged.yaml")), out, resume=True, progress=False)
    assert summary.audit == "renamed" and summary.leak_threshold.margin == 0.1
    info = json.loads((out / "run.json").read_text())
    assert len(info["sessions"]) == 2 and info["device_type"] == "cpu"
    (out / "run.json").write_text(json.dumps({**info, "device_type": "cuda"}))
    with pytest.raises(RunError, match=r"^--resume: .* was run with device cuda and this session has cpu"):
        run_audit(load_audit(write_audit(first)), out, resume=True, progress=False)


@pytest.mark.slow
def test_clean_training_leaves_the_defense_on_the_attacked_update_only(write_audit, tmp_path):
    """utility.train_defended: false (Balunovic et al. 2022's step-500 setting): every setting trains as the
    undefended one does, from the same start on the same batches, so their models and accuracies are equal;
    epsilon is not claimed; the attacked update is still defended."""
    audit = small_audit(defenses=[{"name": "none"}, {"name": "gaussian", "params": {"sigma": 1.0}},
                                  {"name": "dpsgd", "params": {"noise_multiplier": 1.0}}],
                        model={"name": "lenet_zhu", "checkpoints": [0]},
                        attacks=[{"name": "inverting_gradients", "params": {"iterations": 150, "lr": 0.1,
                                                                           "priors": {"tv": 0.01}}}],
                        utility={"train_steps": 5, "batch_size": 8, "train_defended": False})
    summary = run_audit(load_audit(write_audit(audit)), tmp_path / "out", progress=False)
    utility = summary.utility
    accuracies = {u.accuracy for u in utility.values()}
    assert len(accuracies) == 1 and all(u.epsilon is None for u in utility.values())
    rows = {(r["setting"], r["checkpoint"]): r["psnr"] for r in _rows(tmp_path / "out") if r["target"] == 0}
    assert rows[("gaussian(sigma=1.0)", 0)] < rows[("none", 0)] - 3.0  # the shared update is still noised
    quick = [{**audit["attacks"][0], "params": {"iterations": 5}}]  # only its training is asserted on
    defended = run_audit(load_audit(write_audit({**audit, "attacks": quick,
                                                 "utility": {**audit["utility"], "train_defended": True}},
                                                "defended.yaml")), tmp_path / "defended", progress=False)
    assert len({u.accuracy for u in defended.utility.values()}) > 1  # trained under the defenses: they differ
    assert defended.utility["dpsgd(noise_multiplier=1.0)"].epsilon > 0


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_update_is_computed_in_the_model_mode_the_audit_names(write_audit, tmp_path, mode):
    import torch

    from leakaudit.evaluator.results.rundir import RunFolder
    from leakaudit.evaluator.run.scenario import Scenario, loss_fn
    from leakaudit.plugins.protocol import fedsgd_update

    audit = load_audit(write_audit(small_audit(
        model={"name": "convnet", "params": {"width": 4}, "checkpoints": [3], "mode": mode},
        defenses=[{"name": "none"}], utility={"train_steps": 3, "batch_size": 8})))
    scenario, setting = Scenario(audit), audit.settings[0]
    worker = run_worker.AuditWorker(scenario, RunFolder(tmp_path / "out", audit))
    worker.folder.prepare(False)
    worker.train(setting)
    pixels, labels = scenario.target_batch(0)
    problem = worker.problems(setting, 3, [(pixels, labels, 0, None)], "")[0].problem
    model = scenario.fresh_model(scenario.defense(setting))
    model.load_state_dict(worker._states_of(setting)[3])
    expected = {}
    for name in ("eval", "train"):  # eval first: a train-mode pass moves the running statistics
        model.train(name == "train")
        expected[name] = fedsgd_update(model, loss_fn, scenario.normalise(pixels), labels)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(problem.observed.tensors, expected[mode]))
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(expected["train"], expected["eval"]))
    assert problem.threat.model.training == (mode == "train")


def test_an_attack_restricted_to_checkpoints_runs_only_there(write_audit, tmp_path):
    """Geiping et al. (2020, Table 4) weigh total variation differently on the untrained and the trained model."""
    audit = load_audit(write_audit(small_audit(
        model={"name": "lenet_zhu", "checkpoints": [0, 5]}, defenses=[{"name": "none"}],
        attacks=[{"name": "inverting_gradients", "label": "ig_untrained", "checkpoints": [0],
                  "params": {"iterations": 10, "priors": {"tv": 0.0}}},
                 {"name": "inverting_gradients", "label": "ig_trained", "checkpoints": [5],
                  "params": {"iterations": 10, "priors": {"tv": 1e-2}}}])))
    assert [(j.attack.key, j.checkpoint) for j in jobs_of(audit)] == [
        ("ig_untrained", 0), ("ig_untrained", 0), ("ig_trained", 5), ("ig_trained", 5)]
    run_audit(audit, tmp_path / "out", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert sorted({(r["attack"], r["checkpoint"]) for r in rows}) == [("ig_trained", 5), ("ig_untrained", 0)]
    assert (tmp_path / "out" / "report.html").exists()
