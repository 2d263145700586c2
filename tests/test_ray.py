"""The Ray executor: the same rows as the local one, a killed worker's task retried with nothing lost, and a
second node taking work (clusters started inside the tests, on loopback)."""
from __future__ import annotations

import json
import re
import textwrap

import pytest
import yaml

from conftest import small_audit

ray = pytest.importorskip("ray")

from leakaudit.evaluator.audit.config import load_audit  # noqa: E402
from leakaudit.evaluator.run.runner import run_audit  # noqa: E402

PLUGIN = textwrap.dedent('''
    import os
    import signal
    from pathlib import Path

    import ray

    from leakaudit import hookimpl
    from leakaudit.attacks.gradient_matching import InvertingGradients

    HERE = Path(__file__).parent


    class DiesOnce(InvertingGradients):
        """Inverting Gradients whose first task kills its own worker process, as a lost node would."""

        name = "dies_once"

        @classmethod
        def reconstruct_all(cls, problems, max_problems=None):
            marker = HERE / "died"
            if not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return super().reconstruct_all(problems, max_problems)


    class NotesNode(InvertingGradients):
        """Inverting Gradients that notes which Ray node ran it."""

        name = "notes_node"

        @classmethod
        def reconstruct_all(cls, problems, max_problems=None):
            (HERE / f"node-{ray.get_runtime_context().get_node_id()}").touch()
            return super().reconstruct_all(problems, max_problems)


    @hookimpl
    def register_attacks():
        return [DiesOnce, NotesNode]
''')


def audit_file(tmp_path, attack="inverting_gradients", executor=None):
    """The small audit with ``attack``: on the local executor, or on Ray with the ``executor`` settings."""
    (tmp_path / "plugins").mkdir(exist_ok=True)
    (tmp_path / "plugins" / "testing_attacks.py").write_text(PLUGIN)
    audit = small_audit(model={"name": "lenet_zhu", "checkpoints": [0, 5]}, workers=2, plugins_dir="plugins",
                        attacks=[{"name": attack, "params": {"iterations": 20}}])
    if executor is not None:
        audit["executor"] = {"name": "ray", **executor}
    path = tmp_path / f"{attack}.yaml"
    path.write_text(yaml.safe_dump(audit, sort_keys=False))
    return path


def rows(out) -> list[dict]:
    found = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return sorted(({k: v for k, v in r.items() if k not in ("seconds", "attack", "attack_name")} for r in found),
                  key=lambda r: (r["setting"], r["checkpoint"], r["target"]))


@pytest.fixture(scope="module")
def local_ray():
    ray.shutdown()  # a Ray left running by an earlier test (Flower's simulation) would have other CPUs
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    run_audit(load_audit(audit_file(tmp)), tmp / "out", progress=False)
    return rows(tmp / "out")


@pytest.mark.slow
def test_ray_gives_the_local_executors_rows_and_resumes(tmp_path, local_ray, local_rows):
    out = tmp_path / "out"
    summary = run_audit(load_audit(audit_file(tmp_path, executor={})), out, progress=False)
    assert rows(out) == local_rows and len(local_rows) == 8  # 2 settings x 2 steps x 2 targets
    assert json.loads((out / "run.json").read_text())["device"].startswith("ray: 2 CPUs, 0 GPUs on 1 node(s)")
    assert (out / "report.html").is_file() and summary.checkpoints == [0, 5]
    run_audit(load_audit(audit_file(tmp_path, executor={})), out, resume=True, progress=False)
    assert rows(out) == local_rows  # resumed: nothing run or written twice


@pytest.mark.slow
def test_ray_reruns_a_task_whose_worker_was_killed_and_loses_nothing(tmp_path, local_ray, local_rows):
    out = tmp_path / "out"
    run_audit(load_audit(audit_file(tmp_path, "dies_once", {"max_retries": 2})), out, progress=False)
    assert (tmp_path / "plugins" / "died").exists()  # a worker was killed mid-task
    assert rows(out) == local_rows  # every row, each once, with the numbers of the local run


@pytest.mark.slow
def test_ray_task_that_runs_out_of_retries_names_its_cell_and_resume_finishes(tmp_path, local_ray, local_rows):
    from leakaudit.evaluator.results.rundir import RunError

    with pytest.raises(RunError, match=r"attacks \(none, dies_once, step \d\): a Ray worker or node died and the "
                                       r"task's retries ran out"):
        run_audit(load_audit(audit_file(tmp_path, "dies_once", {"max_retries": 0})), tmp_path / "out", progress=False)
    run_audit(load_audit(audit_file(tmp_path, "dies_once", {"max_retries": 0})), tmp_path / "out", resume=True,
              progress=False)  # the worker dies once only: the resumed run finishes
    assert rows(tmp_path / "out") == local_rows


# slow: a two-node Ray cluster; the Ray executor's rows and resume are tested on one node by default
@pytest.mark.heavy
def test_a_second_node_takes_work(tmp_path):
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        out = tmp_path / "out"
        run_audit(load_audit(audit_file(tmp_path, "notes_node", {"address": cluster.address})), out, progress=False)
        assert len({p.name for p in (tmp_path / "plugins").glob("node-*")}) == 2
        assert json.loads((out / "run.json").read_text())["device"].startswith("ray: 2 CPUs, 0 GPUs on 2 node(s)")
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_executor_mistakes_are_one_line_errors_before_any_work(tmp_path):
    import subprocess

    from leakaudit.evaluator.audit.types import ConfigError

    from conftest import LEAKAUDIT

    path = tmp_path / "audit.yaml"
    path.write_text(yaml.safe_dump(small_audit(executor={"name": "ray", "num_cpu": 2, "max_retries": -1})))
    with pytest.raises(ConfigError) as info:
        load_audit(path)
    assert sorted(info.value.lines) == [
        f"{path}: executor.max_retries: -1 is below the minimum 0",
        f"{path}: executor.num_cpu: unknown parameter (did you mean 'num_cpus'?); choices: address, max_retries, "
        "name, num_cpus, num_gpus"]
    path.write_text(yaml.safe_dump(small_audit(executor="slurm")))
    with pytest.raises(ConfigError, match=r"executor.name: 'slurm' is not one of .*local.*ray"):
        load_audit(path)
    done = subprocess.run([*LEAKAUDIT, "run", str(path), "--out", str(tmp_path / "out"), "--executor", "dask"],
                          capture_output=True, text=True)
    assert done.returncode == 2  # argparse quotes the choices on some Pythons only
    assert re.search(r"--executor: invalid choice: 'dask' \(choose from '?local'?, '?ray'?\)", done.stderr)
    assert not (tmp_path / "out").exists()


def test_a_cluster_address_where_nothing_listens_is_one_line_said_at_once(tmp_path, capfd):
    """A closed port: one RunError naming executor.address, before Ray's client retries it (aloud) for minutes."""
    import socket

    from leakaudit.evaluator.results.rundir import RunError

    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.shutdown()
    with pytest.raises(RunError, match=rf"^executor: cannot join the Ray cluster at 127\.0\.0\.1:{port}: nothing answers "
                                       rf"at 127\.0\.0\.1:{port} \(Connection refused\); start it .* executor\.address$"):
        run_audit(load_audit(audit_file(tmp_path, executor={"address": f"127.0.0.1:{port}"})), tmp_path / "out",
                  progress=False)
    assert capfd.readouterr().err == ""
