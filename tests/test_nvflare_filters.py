"""NVIDIA FLARE's privacy filters as defenses (defenses/nvflare.py): the update filtered by FLARE's own filter
classes, the likelihood's centre equal to what FLARE sends, the guarantee as configured, the extra refused in one
line where FLARE is missing. check_defense on each runs in tests/test_checks.py (BUILTIN_SETTINGS)."""
from __future__ import annotations

import json
import math
import sys
from importlib import import_module
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from leakaudit.defenses import nvflare as flare_defenses
from leakaudit.defenses.nvflare import (FlareExcludeVars, FlareJob, FlarePercentile, FlareSvt, numpy_percentile,
                                       svt_epsilons)
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.plugins.defense import SharedUpdate
from leakaudit.plugins.protocol import FEDSGD, FedAvg

pytest.importorskip("nvflare")


def _update() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [0.05 * torch.randn(4, 3, generator=g), 0.05 * torch.randn(5, generator=g)]


def _flare(filter_, arrays: dict) -> dict:
    from nvflare.apis.dxo import DXO, DataKind, from_shareable
    from nvflare.apis.fl_context import FLContext

    shareable = DXO(data_kind=DataKind.WEIGHT_DIFF, data={k: v.copy() for k, v in arrays.items()}).to_shareable()
    return from_shareable(filter_.process(shareable, FLContext())).data


def test_percentile_sends_what_flares_filter_sends_and_its_likelihood_is_centred_there():
    from nvflare.app_common.filters import PercentilePrivacy

    update = _update()
    defense = FlarePercentile(percentile=40.0, gamma=0.06)
    sent = defense.perturb(update, torch.Generator().manual_seed(0))
    expected = _flare(PercentilePrivacy(percentile=40, gamma=0.06), {"a": update[0].numpy(), "b": update[1].numpy()})
    assert all(torch.equal(s, torch.from_numpy(expected[k])) for s, k in zip(sent, "ab"))
    assert all(torch.equal(s, t) for s, t in zip(sent, defense.transform(update)))  # the likelihood's centre
    zeroed = sum(int((s == 0).sum()) for s in sent)
    assert zeroed == 7  # under the 40th percentile of 17 magnitudes (between the 7th and 8th smallest)
    assert max(float(s.abs().max()) for s in sent) == pytest.approx(0.06)
    shared = SharedUpdate(sent, ["a", "b"], 1)
    assert float(defense.log_likelihood(shared, update)) == 0.0
    moved = [update[0] + 1.0, update[1]]  # every coordinate of "a" clipped to 0.06 where it was kept
    centre = defense.transform(moved)
    assert float(defense.log_likelihood(shared, moved)) == pytest.approx(
        -0.5 * sum(float(((s - c) ** 2).sum()) for s, c in zip(sent, centre)), rel=1e-6)
    values = torch.rand(101, dtype=torch.float64)
    for q in (0.0, 10.0, 37.5, 50.0, 99.0, 100.0):
        assert float(numpy_percentile(values, q)) == np.percentile(values.numpy(), q)


def test_percentile_states_no_guarantee():
    profile = FlarePercentile().privacy_profile()
    assert profile.mu == math.inf and profile.reconstruction_bound(0.01) == 1.0
    assert profile.mechanism == ("NVFlare PercentilePrivacy: magnitudes under the 10th percentile zeroed, the rest "
                                 "clipped to 0.01; WARNING: not differential privacy: no noise is added, so no "
                                 "epsilon bounds what it leaks")
    assert FlarePercentile.params["percentile"].protects == "higher"


def test_exclude_vars_sends_flares_kept_tensors_and_zeros_for_the_excluded():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 5))
    update = [torch.randn(p.shape) for p in model.parameters()]
    by_list, by_regex = FlareExcludeVars(exclude_vars=["2.weight"]), FlareExcludeVars(exclude_vars=r"^0\.")
    for defense, gone in ((by_list, {"2.weight"}), (by_regex, {"0.weight", "0.bias"})):
        with pytest.raises(ValueError, match="call wrap_model"):
            defense.perturb(update, torch.Generator())
        defense.wrap_model(model)
        sent = defense.perturb(update, torch.Generator())
        names = ["0.weight", "0.bias", "2.weight", "2.bias"]
        for n, s, u in zip(names, sent, update):
            assert torch.equal(s, torch.zeros_like(u) if n in gone else u)
        assert defense.defended_tensors(names) == gone
        shared = SharedUpdate(sent, names, 1)
        assert float(defense.log_likelihood(shared, update)) == 0.0
        other = [u + 1 for u in update]  # only the shared tensors count: 1 per shared coordinate
        shared_size = sum(u.numel() for n, u in zip(names, update) if n not in gone)
        assert float(defense.log_likelihood(shared, other)) == pytest.approx(-0.5 * shared_size)
    assert by_regex.model_changes == ["not shared (ExcludeVars): 0.weight, 0.bias"]
    with pytest.raises(ValueError) as exc:
        FlareExcludeVars(exclude_vars=["fc.weight"]).wrap_model(model)
    assert str(exc.value) == ("nvflare_exclude_vars: exclude_vars names fc.weight, not a trainable parameter of the "
                              "model; choices: 0.weight, 0.bias, 2.weight, 2.bias")


def test_refusals_are_one_line(monkeypatch):
    defense = FlarePercentile()
    assert defense.unsupported(FEDSGD) is None
    assert defense.unsupported(FedAvg(clients=3)) == ("nvflare_percentile filters one client's update; with clients: "
                                                      "3 the protocol would filter their mean: use clients: 1")
    monkeypatch.setattr(flare_defenses, "find_spec", lambda name: None)
    assert defense.unsupported(FEDSGD) == "nvflare_percentile needs NVIDIA FLARE: pip install 'leakaudit[nvflare]'"


def test_svt_sends_what_flares_filter_sends_and_leaves_numpys_generator_alone():
    from nvflare.app_common.filters import SVTPrivacy

    update, defense = _update(), FlareSvt(fraction=0.5, gamma=0.04)
    np.random.seed(11)
    before = np.random.get_state()[1].copy()
    sent = defense.perturb(update, torch.Generator().manual_seed(5))
    assert (np.random.get_state()[1] == before).all()  # the user's NumPy draws are untouched
    np.random.seed(int(torch.randint(0, 2 ** 31 - 1, (1,), generator=torch.Generator().manual_seed(5)).item()))
    expected = _flare(SVTPrivacy(fraction=0.5, gamma=0.04), {"000000": update[0].numpy(), "000001": update[1].numpy()})
    assert all(torch.equal(s, torch.from_numpy(expected[k])) for s, k in zip(sent, ("000000", "000001")))
    assert 0 < sum(int((s != 0).sum()) for s in sent) <= 9  # ceil(0.5 * 17) drawn with replacement
    scale = 2 * 0.04 / 0.1  # 2 gamma n_upload / (n_upload noise_var)
    assert defense.release_scale(17) == pytest.approx(scale, rel=1e-12)
    shared = SharedUpdate(sent, ["a", "b"], 1)
    expected_ll = sum(float((-(s - u.clamp(-0.04, 0.04)).abs() / scale * (s != 0)).sum()) for s, u in zip(sent, update))
    assert float(defense.log_likelihood(shared, update)) == pytest.approx(expected_ll, rel=1e-6)


def test_svt_epsilon_at_flares_defaults_is_flips_figure_for_seven_million_parameters():
    """FLIP (londonaicentre/FLIP #1145) measured about 70,000 per round at the stock defaults: noise_var 0.1 per
    coordinate sent, a tenth of 7 million coordinates."""
    spent = svt_epsilons(0.1, 0.1, 0.1, 7_000_000)
    assert spent["n_upload"] == 700_000 and spent["release"] == pytest.approx(70_000.0, rel=1e-12)
    assert spent["flare"] == pytest.approx(70_000.1, rel=1e-12)  # FLARE's accountant: threshold + query + release
    assert spent["worst"] == pytest.approx(70_000.1 + spent["query"] * 9, rel=1e-12)  # up to 10 x n_upload answers
    defense = FlareSvt(parameters=2410, rounds=3)  # the tiny case's MLP
    profile = defense.privacy_profile()
    tiny = svt_epsilons(0.1, 0.1, 0.1, 2410)
    assert tiny["release"] == pytest.approx(24.1) and profile.pairs == ((tiny["worst"], 0.0),)
    assert f"epsilon {tiny['worst']:.6g} per round (delta 0), {3 * tiny['worst']:.6g} over 3 rounds" in profile.mechanism
    assert "WARNING: epsilon 25.1 per round is past any meaningful range" in profile.mechanism
    assert defense.privacy_spent(4, 1.0, 1e-5) == pytest.approx(4 * tiny["worst"])
    unknown = FlareSvt().privacy_profile()
    assert unknown.mu == math.inf and unknown.mechanism.endswith("unknown here: give parameters")
    wrapped = FlareSvt()
    wrapped.wrap_model(nn.Linear(60, 40))
    assert wrapped.privacy_profile().pairs == ((svt_epsilons(0.1, 0.1, 0.1, 2440)["worst"], 0.0),)


def _job(tmp_path, filters: list, tasks=("train",), executors=()) -> str:
    path = tmp_path / "config_fed_client.json"
    path.write_text(json.dumps({"format_version": 2, "executors": list(executors),
                                "task_result_filters": [{"tasks": list(tasks), "filters": filters}],
                                "task_data_filters": [], "components": []}))
    return str(path)


def test_an_nvflare_jobs_result_filters_are_the_audited_defense(tmp_path, write_audit):
    path = _job(tmp_path, [{"path": "nvflare.app_common.filters.PercentilePrivacy", "args": {"percentile": 20}},
                           {"name": "SVTPrivacy", "args": {"fraction": 0.5, "gamma": 0.04}}])
    audit = {"name": "nvflare", "seed": 0, "device": "cpu",
             "data": {"dataset": "digits", "image_size": 8, "targets": 2, "batch_size": 1},
             "model": {"name": "mlp", "checkpoints": [0]}, "protocol": {"name": "fedsgd"},
             "defenses": [{"name": "nvflare_job", "params": {"path": path}}], "metrics": ["psnr"]}
    loaded = load_audit(write_audit(audit))
    job = next(s for s in loaded.settings if not s.added).build(loaded.registry)
    assert [m.settings for m in job.members] == [{"percentile": 20, "gamma": 0.01}, {**FlareSvt().settings,
                                                                                     "fraction": 0.5, "gamma": 0.04}]
    update = _update()
    sent, _ = job.apply(update, torch.Generator().manual_seed(2))
    by_hand = job.members[1].perturb(job.members[0].perturb(update, torch.Generator()), torch.Generator().manual_seed(2))
    assert all(torch.equal(a, b) for a, b in zip(sent, by_hand))
    shared = SharedUpdate(sent, ["a", "b"], 1)
    assert float(job.log_likelihood(shared, update)) == float(job.members[1].log_likelihood(
        shared, job.members[0].transform(update)))
    assert not job.deterministic and job.has_likelihood()
    stated = FlareJob(path=path, parameters=2410).privacy_profile()  # SVTPrivacy's, for 2410 coordinates
    assert stated.pairs == ((svt_epsilons(0.5, 0.1, 0.1, 2410)["worst"], 0.0),)


def test_a_job_filter_leakaudit_cannot_read_is_one_line_before_any_work(tmp_path, write_audit):
    audit = {"name": "nvflare", "seed": 0, "device": "cpu",
             "data": {"dataset": "digits", "image_size": 8, "targets": 2, "batch_size": 1},
             "model": {"name": "mlp", "checkpoints": [0]}, "protocol": {"name": "fedsgd"}, "metrics": ["psnr"]}
    cases = [([{"path": "nvflare.app_common.filters.statistics_privacy_filter.StatisticsPrivacyFilter"}], "filter "
              "'StatisticsPrivacyFilter' is not one leakaudit audits; choices: ExcludeVars, PercentilePrivacy, "
              "SVTPrivacy"),
             ([{"name": "PercentilePrivacy", "args": {"data_kinds": ["METRICS"]}}], "PercentilePrivacy's data_kinds "
              "['METRICS']; choices: WEIGHT_DIFF, WEIGHTS"),
             ([{"name": "PercentilePrivacy", "args": {"noise": 1}}], "PercentilePrivacy's noise is not read by "
              "leakaudit; choices: data_kinds, percentile, gamma"),
             ([{"name": "SVTPrivacy"}, {"name": "ExcludeVars", "args": {"exclude_vars": "fc"}}], "svt (filter 1 of 2) "
              "is random; only the last filter may be")]
    for filters, line in cases:
        path = _job(tmp_path, filters)
        with pytest.raises(ConfigError) as exc:
            load_audit(write_audit({**audit, "defenses": [{"name": "nvflare_job", "params": {"path": path}}]}))
        assert line in str(exc.value) and len(exc.value.lines) == 1
    path = _job(tmp_path, [{"name": "PercentilePrivacy"}], tasks=("validate",))
    with pytest.raises(ValueError) as info:
        FlareJob(path=path)
    assert str(info.value) == ("nvflare_job: the job filters no WEIGHT_DIFF result of task 'train': its update is "
                               "sent as it is (audit it as defense none)")


def test_a_missing_flare_is_one_line_before_any_work(write_audit, monkeypatch):
    monkeypatch.setattr(flare_defenses, "find_spec", lambda name: None)
    audit = {"name": "nvflare", "seed": 0, "device": "cpu",
             "data": {"dataset": "digits", "image_size": 8, "targets": 2, "batch_size": 1},
             "model": {"name": "mlp", "checkpoints": [0]}, "protocol": {"name": "fedsgd"},
             "defenses": [{"name": "nvflare_svt"}], "metrics": ["psnr"]}
    with pytest.raises(ConfigError) as exc:
        load_audit(write_audit(audit))
    assert exc.value.lines[0].endswith("defenses[0]: nvflare_svt: nvflare_svt needs NVIDIA FLARE: pip install "
                                       "'leakaudit[nvflare]'")


EXAMPLE = Path(__file__).parent.parent / "examples" / "nvflare_job"
CLIENT_API = "nvflare.app_common.executors.client_api_executor.ClientAPIExecutor"


def test_the_shipped_job_is_what_flares_job_api_exports(tmp_path):
    """examples/nvflare_job/job/ is FLARE 2.9's own export of export_job.py (offline), byte for byte."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        exported = import_module("export_job").export(tmp_path)
    finally:
        sys.path.remove(str(EXAMPLE))
    made = sorted(p.relative_to(exported) for p in exported.rglob("*") if p.is_file())
    assert made == sorted(p.relative_to(EXAMPLE / "job") for p in (EXAMPLE / "job").rglob("*") if p.is_file())
    assert all((exported / p).read_bytes() == (EXAMPLE / "job" / p).read_bytes() for p in made)
    client = json.loads((exported / "app_site-1" / "config" / "config_fed_client.json").read_text())
    assert client["task_result_filters"][0]["filters"] == [{
        "path": "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",
        "args": {"data_kinds": ["WEIGHT_DIFF", "WEIGHTS"]}}]  # MediSwarm's 10 and 0.01 are FLARE's defaults


def test_the_exported_job_runs_from_another_working_directory(tmp_path, monkeypatch):
    """The job's path is read beside the audit file; the setting keeps it as written, and the report's privacy
    table says in words that PercentilePrivacy is not differential privacy."""
    monkeypatch.chdir(tmp_path)
    audit = load_audit(EXAMPLE / "audit.yaml")
    setting = next(s for s in audit.settings if not s.added)
    assert setting.members == (("nvflare_job", {"path": "job/app_site-1/config/config_fed_client.json"}),)
    job = setting.build(audit.registry)
    assert [m.settings for m in job.members] == [{"percentile": 10.0, "gamma": 0.01}]
    assert "not differential privacy" in job.privacy_profile().mechanism
    assert str(tmp_path) not in setting.key and str(EXAMPLE) not in setting.key


def test_data_kinds_and_the_kind_the_executor_sends_decide_what_is_filtered(tmp_path):
    diff = {"tasks": ["train"], "executor": {"path": CLIENT_API, "args": {"params_transfer_type": "DIFF"}}}
    full = {"tasks": ["train"], "executor": {"path": CLIENT_API, "args": {}}}  # FULL: FLARE's default
    weights_only = [{"name": "PercentilePrivacy", "args": {"data_kinds": ["WEIGHTS"]}}]
    with pytest.raises(ValueError) as info:
        FlareJob(path=_job(tmp_path, weights_only, executors=[diff]))
    assert str(info.value) == ("nvflare_job: the job filters no WEIGHT_DIFF result of task 'train': its update is "
                               "sent as it is (audit it as defense none)")
    with pytest.raises(ValueError) as info:
        FlareJob(path=_job(tmp_path, [{"name": "PercentilePrivacy"}], executors=[full]))
    assert str(info.value).startswith("nvflare_job: task_result_filters[0].filters[0]: PercentilePrivacy filters full "
                                      "weights here (the task's ClientAPIExecutor sends WEIGHTS")
    excluded = FlareJob(path=_job(tmp_path, [{"name": "ExcludeVars", "args": {"exclude_vars": "bias$"}}],
                                  executors=[full]))  # the same tensors left out of weights as of their change
    assert excluded.members[0].settings == {"exclude_vars": "bias$"}
    both = FlareJob(path=_job(tmp_path, [{"name": "PercentilePrivacy", "args": {"data_kinds": []}}], executors=[diff]))
    assert both.members[0].settings == {"percentile": 10.0, "gamma": 0.01}  # empty: FLARE's default, both kinds


def test_exclude_vars_with_empty_args_excludes_nothing_as_flare_runs_it(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 5))
    job = FlareJob(path=_job(tmp_path, [{"path": "nvflare.app_common.filters.exclude_vars.ExcludeVars", "args": {}},
                                        {"name": "PercentilePrivacy", "args": {"percentile": 20}}]))
    exclude = job.members[0]
    exclude.wrap_model(model)
    update = [torch.randn(p.shape) for p in model.parameters()]
    sent = exclude.perturb(update, torch.Generator())
    assert all(torch.equal(s, u) for s, u in zip(sent, update)) and exclude.defended_tensors(["0.weight"]) == set()
    assert exclude.model_changes == ["not shared (ExcludeVars): none"]
