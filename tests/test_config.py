"""Audit files: every bad input is one clear line (file, key, value, choices) and exit 2, before work."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.cli import main

from conftest import LEAKAUDIT, ROOT, small_audit


def problems(path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_audit(path)
    return info.value.lines


def test_quickstart_is_valid():
    audit = load_audit(ROOT / "configs" / "quickstart.yaml")
    assert [s.key for s in audit.settings] == ["none", "gaussian(sigma=0.01)", "gaussian(sigma=0.1)",
                                              "gaussian(sigma=1.0)"]
    assert audit.num_batches == 4 and audit.checkpoints == [0]


def test_a_small_audit_without_metrics_leaves_lpips_out_with_a_note(write_audit, capsys):
    plain = small_audit()
    del plain["metrics"]
    path = write_audit(plain)
    audit = load_audit(path)
    assert audit.metrics == ["psnr", "ssim", "mse", "label_accuracy"] and audit.leakage_metric == "psnr"
    assert main(["validate", str(path)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert notes == ["  note: metrics: lpips left out of the default metrics: it needs images of at least 31 px and "
                     "data.image_size is 16 (list it under metrics: at a larger image_size)"]
    assert "lpips" in load_audit(write_audit({**plain, "data": {**plain["data"], "image_size": 32}}, "big.yaml")).metrics


def test_misspelt_defense_names_the_choices(write_audit):
    path = write_audit(small_audit(defenses=[{"name": "gausian"}]))
    (line,) = problems(path)
    assert line.startswith(f"{path}: defenses[0].name: 'gausian' is not a registered defense (did you mean 'gaussian'?); choices: ")
    assert "gaussian" in line and "none" in line


def test_a_bare_name_is_the_entry_of_that_name(write_audit):
    """`attacks: [bayes, cinet]` and `defenses: [none, ...]` read as `{name: ...}` entries with their defaults."""
    audit = load_audit(write_audit(small_audit(defenses=["none", {"name": "gaussian", "params": {"sigma": 0.1}}],
                                               attacks=["inverting_gradients", "bayes"])))
    assert [a.name for a in audit.attacks] == ["inverting_gradients", "bayes"] and audit.attacks[0].params == {}
    assert [s.key for s in audit.settings] == ["none", "gaussian(sigma=0.1)"]


def test_negative_sigma_in_a_sweep_is_located(write_audit):
    path = write_audit(small_audit(defenses=[{"name": "gaussian", "sweep": {"sigma": [0.1, -0.5]}}]))
    assert problems(path) == [f"{path}: defenses[0].sweep.sigma[1]: -0.5 must be greater than 0.0"]


def test_missing_data_folder_says_what_to_put_where(write_audit, tmp_path):
    missing = tmp_path / "nowhere"
    path = write_audit(small_audit(data={"dataset": "cifar10", "root": str(missing)}))
    assert problems(path) == [f"{path}: data.root: folder {missing} does not exist; put cifar-10-batches-py/ there, "
                              "or set download: true"]


@pytest.mark.parametrize("audit, expected", [
    (small_audit(precision="float16"), "precision: 'float16' is not one of the choices; choices: float32, bfloat16"),
    (small_audit(defenses=[{"name": "none"}, {"name": "frozen_embeddings"}]),
     "defenses (frozen_embeddings): frozen_embeddings applies to text; data.dataset digits holds image"),
    (small_audit(defenses=[{"name": "none"}], attacks=[{"name": "token_set"}]),
     "attacks[0]: token_set reconstructs text; data.dataset digits holds image (attacks for image: analytic,"),
    (small_audit(data={"dataset": "digits", "datset": 1}), "data.datset: unknown parameter (did you mean 'dataset'?); choices: batch_size, "),
    (small_audit(data={"dataset": "digits", "targets": 3, "batch_size": 2}),
     "data.targets: 3 is not a multiple of data.batch_size 2"),
    (small_audit(seed="zero"), "seed: 'zero' is not of type int"),
    (small_audit(device="tpu"), "device: 'tpu' is not one of the choices; choices: auto, cpu, cuda"),
    (small_audit(metrics=["psnr", "fid"]), "metrics[1]: 'fid' is not a registered metric; choices: "),
    (small_audit(metrics=["psnr", "lpips"]), "metrics[1]: lpips needs images of at least 31 px and data.image_size is 16"),
    (small_audit(model={"name": "lenet"}), "model.name: 'lenet' is not a registered model"),
    (small_audit(model={"name": "no_such_pkg.mod:build"}), "model.name: cannot import module 'no_such_pkg.mod'"),
    (small_audit(model={"name": "lenet_zhu", "checkpoints": [0, -3]}), "model.checkpoints[1]: -3 is not a training step"),
    (small_audit(attacks=[{"name": "inverting_gradients", "params": {"iterations": 0}}]),
     "attacks[0].params.iterations: 0 is below the minimum 1"),
    (small_audit(attacks=[{"name": "inverting_gradients", "params": {"step": 3}}]),
     "attacks[0].params.step: unknown parameter; choices: bn_prior, bn_weight, drop_defended, iterations, label_method, lr, priors, restarts, signed"),
    (small_audit(defenses=[{"name": "gaussian"}]), "defenses[0].params.sigma: required parameter is missing"),
    (small_audit(defenses=[{"name": "none"}, {"name": "none"}]), "defenses[1]: setting none appears twice"),
    (small_audit(data={"dataset": "digits", "image_size": 32, "targets": 2, "batch_size": 1, "params": {"crops": 3}}),
     "data.params.crops: unknown parameter; choices: (none: takes no parameters)"),
    (small_audit(defenses=[{"chain": [{"name": "gaussian", "params": {"sigma": 0.1}},
                                      {"name": "clip", "params": {"max_norm": 1.0}}]}]),
     "defenses[0]: gaussian(sigma=0.1)>clip(max_norm=1.0): chain: only the last member may be random; "
     "'gaussian' at position 0 is random"),
    (small_audit(defenses=[{"chain": [{"name": "clip", "params": {"max_norm": 1.0}}, {"name": "gausian"}]}]),
     "defenses[0].chain[1].name: 'gausian' is not a registered defense (did you mean 'gaussian'?); choices: ats, bayesian, clip, dpsgd, "
     "flower_adaptive_clipping, flower_fixed_clipping, flower_local_dp, frozen_embeddings, gaussian, "),  # then cut at 400
    (small_audit(defenses=[{"chain": [{"name": "clip", "params": {"max_norm": 1.0}}, {"name": "dpsgd"}]}]),
     "defenses[0]: clip(max_norm=1.0)>dpsgd: chain: 'dpsgd' computes its update from the model and inputs "
     "and cannot be a chain member"),
    (small_audit(defenses=[{"name": "dpsgd", "params": {"target_epsilon": 2.0}}]),
     "defenses[0]: dpsgd(target_epsilon=2.0): dpsgd: target_epsilon needs steps and sample_rate"),
    (small_audit(utility={"train_steps": 5, "delta": 0}), "utility.delta: 0 must be greater than 0.0"),
    (small_audit(defenses=[{"name": "dpsgd", "params": {"accountant": "moments"}}]),
     "defenses[0].params.accountant: 'moments' is not one of the choices; choices: rdp, prv, gdp"),
    (small_audit(defenses=[{"name": "prune", "params": {"noise": "gaussian"}}]),
     "defenses[0]: prune(noise=gaussian): prune: noise 'gaussian' needs scale > 0, got 0.0"),
    (small_audit(protocol={"name": "fedsgd", "local_lr": 0.1}), "protocol.local_lr: only applies to protocol fedavg"),
    (small_audit(protocol="fedprox"), "protocol.name: 'fedprox' is not a protocol; choices: fedsgd, fedavg, step"),
    (small_audit(leakage_metric="lpips"),
     "leakage_metric: 'lpips' is not one of this audit's metrics; choices: psnr, ssim, mse, label_accuracy"),
    (small_audit(max_problems=0), "max_problems: 0 is neither 'auto' nor a whole number >= 1; choices: auto, 1, 2, ..."),
    (small_audit(protocol={"name": "step", "lr": 0.1}), "protocol.function: required for protocol step"),
    (small_audit(protocol={"name": "fedavg", "local_batch_size": 4}),
     "protocol.local_batch_size: 4 is larger than the 1 images each client holds (data.batch_size / protocol.clients)"),
    (small_audit(attacks=[{"name": "inverting_gradients", "params": {"priors": {"tvv": 1.0}}}]),
     "attacks[0].params: unknown prior 'tvv'; choices: tv, tv_iso, l2, range"),
    (small_audit(threat={"known_labels": "yes"}), "threat.known_labels: 'yes' is not of type bool"),
    (small_audit(utility={"lr": -0.1}), "utility.lr: -0.1 must be greater than 0.0"),
    (small_audit(attacks=[{"name": "inverting_gradients"}, {"name": "inverting_gradients"}]),
     "attacks[1].label: attack label 'inverting_gradients' is used twice; give each a distinct label"),
    (small_audit(attacks=[{"name": "bayes", "params": {"samples": 0}}]),
     "attacks[0].params.samples: 0 is below the minimum 1"),
    (small_audit(defenses=[{"name": "laplace", "params": {"scale": 0.0}}]),
     "defenses[0].params.scale: 0.0 must be greater than 0.0"),
    (small_audit(defenses=[{"name": "topk", "params": {"fraction": 0.0}}]),
     "defenses[0].params.fraction: 0.0 must be greater than 0.0"),
    (small_audit(defenses=[{"name": "clip"}]), "defenses[0].params.max_norm: required parameter is missing"),
    (small_audit(defenses=[{"name": "prune", "params": {"mask": "sometimes"}}]),
     "defenses[0].params.mask: 'sometimes' is not one of the choices; choices: per_round, fixed"),
    (small_audit(defenses=[{"name": "none", "chain": [{"name": "clip", "params": {"max_norm": 1.0}}]}]),
     "defenses[0]: give either name (with params, sweep) or chain, not both"),
])
def test_each_problem_is_one_line(write_audit, audit, expected):
    path = write_audit(audit)
    (line,) = problems(path)
    assert line.startswith(f"{path}: {expected}"), line


def test_exponent_floats_read_as_numbers(tmp_path):
    path = tmp_path / "audit.yaml"
    audit = small_audit()
    del audit["attacks"]
    path.write_text(yaml.safe_dump(audit) + "attacks:\n  - {name: inverting_gradients, "
                    "params: {iterations: 20, lr: 1e-2, priors: {tv: 5E-4}}}\n")
    (spec,) = load_audit(path).attacks
    assert spec.params["lr"] == 0.01 and spec.params["priors"] == {"tv": 0.0005}


def test_all_problems_are_reported_at_once(write_audit):
    path = write_audit(small_audit(seed=-1, defenses=[{"name": "nope"}], metrics=["psnr", "nope"]))
    lines = [line.removeprefix(f"{path}: ") for line in problems(path)]
    assert [line.split(":")[0] for line in lines] == ["seed", "defenses[0].name", "metrics[1]"]
    assert lines[0] == "seed: -1 is below the minimum 0"
    assert lines[1].startswith("defenses[0].name: 'nope' is not a registered defense (did you mean 'none'?); choices: ")
    assert lines[2].startswith("metrics[1]: 'nope' is not a registered metric; choices: ")


def test_validate_command_exits_2_with_one_line(write_audit, capsys):
    path = write_audit(small_audit(defenses=[{"name": "gausian"}]))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "defenses[0].name" in err[0]


@pytest.mark.slow
def test_run_rejects_bad_file_before_any_work(write_audit, tmp_path):
    path = write_audit(small_audit(defenses=[{"name": "gaussian", "params": {"sigma": -1.0}}]))
    out = tmp_path / "out"
    proc = subprocess.run([*LEAKAUDIT, "run", str(path), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"leakaudit: error: {path}: defenses[0].params.sigma: -1.0 must be greater than 0.0"
    assert not out.exists()


def test_not_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    (line,) = problems(bad)
    assert line == f"{bad}: line 1: the '[' opened here is not closed; end it with ']' on the same line, or write " \
                   "one item per line"
    assert problems(tmp_path / "absent.yaml") == [f"{tmp_path / 'absent.yaml'}: file not found"]


def test_chains_and_protocols_expand(write_audit):
    audit = load_audit(write_audit(small_audit(
        defenses=[{"chain": [{"name": "clip", "params": {"max_norm": 1.0}},
                             {"name": "gaussian", "sweep": {"sigma": [0.1, 0.2]}}]}],
        protocol={"name": "fedavg", "local_epochs": 5, "local_lr": 0.01})))
    assert [s.key for s in audit.settings] == ["clip(max_norm=1.0)>gaussian(sigma=0.1)",
                                              "clip(max_norm=1.0)>gaussian(sigma=0.2)", "none"]
    assert audit.settings[-1].added and not audit.settings[0].added  # the reference that calibrates them
    assert audit.settings[0].name == "clip>gaussian"
    assert audit.settings[0].params == {"clip.max_norm": 1.0, "gaussian.sigma": 0.1}
    assert audit.protocol.name == "fedavg" and audit.protocol.local_steps(1) == 5


def test_an_attack_that_cannot_apply_is_refused_before_work(write_audit, capsys):
    path = write_audit(small_audit(attacks=[{"name": "analytic"}]))
    assert main(["validate", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"leakaudit: error: {path}: attacks[0]: analytic: the model must start with a fully connected layer "
        "(after an optional Flatten), as nn.Sequential; for convolutional inputs use a layer-wise attack")


def test_missing_plugins_dir_names_the_folder(write_audit, tmp_path):
    path = write_audit(small_audit(plugins_dir="no_such_folder"))
    assert problems(path) == [f"{path}: plugins_dir: plugins folder {tmp_path / 'no_such_folder'} does not exist"]


@pytest.mark.parametrize("section, spec", [
    ("DataSection", "DATA"), ("ModelSection", "MODEL"), ("UtilitySection", "UTILITY"), ("ThreatSection", "THREAT"),
    ("VerdictSection", "VERDICT"), ("ExecutorSection", "EXECUTOR")])
def test_each_typed_section_has_the_keys_and_defaults_of_its_spec_table(section, spec):
    """The Param tables stay the one source of validation: each typed section declares exactly their keys, with
    their defaults (a key added to a table but not to its type, or a default changed in one place, fails)."""
    import dataclasses
    import types as types_
    import typing

    from leakaudit.evaluator.audit import specs, types

    cls, table = getattr(types, section), getattr(specs, spec)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(fields) == set(table)
    made = cls()
    assert {k: getattr(made, k) for k in table} == {k: p.default for k, p in table.items()}
    hints = typing.get_type_hints(cls)  # and the type each key's Param checks, None where it may be unset
    for key, param in table.items():
        declared = set(param.type if isinstance(param.type, tuple) else (param.type,))
        if param.nullable or param.default is None:
            declared.add(type(None))
        args = typing.get_args(hints[key]) if typing.get_origin(hints[key]) in (typing.Union, types_.UnionType) \
            else (hints[key],)
        assert {typing.get_origin(a) or a for a in args} >= declared, f"{section}.{key}: {hints[key]} against {declared}"


def test_a_loaded_audit_holds_typed_sections_and_no_mapping(write_audit):
    audit = load_audit(write_audit(small_audit()))
    assert audit.data.image_size == 16 and audit.model.checkpoints == [0] and audit.utility.train_steps == 5
    assert audit.verdict.statistic == "mean" and audit.executor.name == "local" and audit.threat.known_labels is False
    assert not [name for name, value in vars(audit).items() if isinstance(value, dict)]
