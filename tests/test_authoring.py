"""The authoring commands: leakaudit plugins KIND NAME, init, new-plugin and schema."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from leakaudit.evaluator.audit.config import ConfigError, load_audit
from leakaudit.evaluator.authoring.starter import starter_audit
from leakaudit.evaluator.cli import main
from leakaudit.evaluator.run.scenario import Scenario, check_scenario


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plugins_kind_name_shows_parameters_paper_and_origin(capsys):
    code, out, _ = _run(capsys, "plugins", "defense", "prune")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("defense prune: Zeroes a random fraction of coordinates")
    assert "  paper:      Balunovic et al. 2022 (references: docs/references.md)" in lines
    assert "  origin:     builtin:leakaudit.defenses.pruning" in lines
    assert any(line.split() == ["fraction", "float,", "default", "0.5,", ">=0.0", "<=0.99,", "higher", "protects",
                                "more:", "a", "frontier", "knob", "share", "of", "coordinates", "zeroed"]
               for line in lines)
    assert any("noise" in line and "one of none|gaussian|laplace" in line for line in lines)
    assert "likelihood is the per-coordinate mixture" in out  # the docstring beyond its summary


def test_plugins_kind_name_json(capsys):
    code, out, _ = _run(capsys, "plugins", "defense", "gaussian", "--json")
    info = json.loads(out)
    (sigma,) = info["params"]
    assert code == 0 and info["paper"] == "Balunovic et al. 2022"
    assert sigma["name"] == "sigma" and sigma["required"] and sigma["example"] == 0.1 and sigma["exclusive_min"]
    assert info["facts"]["likelihood"].startswith("declared")


def test_plugins_of_one_kind(capsys):
    code, out, _ = _run(capsys, "plugins", "attack")
    header, *rows = out.splitlines()
    assert code == 0 and header.split()[:2] == ["KIND", "NAME"] and {line.split()[0] for line in rows} == {"attack"}
    assert "bayes" in {line.split()[1] for line in rows}


@pytest.mark.parametrize("argv, line", [
    (("plugins", "defence"), "leakaudit: error: plugins: KIND 'defence' is not a kind (did you mean 'defense'?); "
                             "choices: defense, attack, metric, model, dataset"),
    (("plugins", "defense", "gausian"), "leakaudit: error: plugins: defense 'gausian' is not registered (did you "
                                        "mean 'gaussian'?); defenses: ats, bayesian, clip, dpsgd, "
                                        "flower_adaptive_clipping, flower_fixed_clipping, flower_local_dp, "
                                        "frozen_embeddings, gaussian, laplace, lora, none, nvflare_exclude_vars, "
                                        "nvflare_job, nvflare_percentile, nvflare_svt, precode, prune, qsgd, "
                                        "signsgd, soteria, topk"),
])
def test_plugins_typos_are_one_line(capsys, argv, line):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == "" and err.splitlines() == [line]


def test_init_prints_a_commented_audit_that_validates(capsys, tmp_path):
    code, out, _ = _run(capsys, "init", "--defense", "gaussian", "--defense", "precode")
    assert code == 0
    assert ("      sigma: 0.1            # noise standard deviation (float, required, e.g. 0.1, >0.0, higher protects "
            "more: a frontier knob)") in out
    assert "      # size: 256           # bottleneck size K (int, default 256, >=1)" in out
    audit = load_audit(tmp_path / "starter.yaml", text=out)
    check_scenario(Scenario(audit), user_code=False)
    assert [s.key for s in audit.settings] == ["none", "gaussian(sigma=0.1)", "precode"]
    scopes = {a.name: a.defenses for a in audit.attacks}
    assert scopes["inverting_gradients"] is None and scopes["bayes"] == ("gaussian",)
    assert scopes["precode_sample"] == ("precode",)  # the attack built on the defense without a likelihood


def test_init_for_every_defense_validates(registry, tmp_path):
    for name in set(registry.names("defense")) - {"nvflare_job"}:  # it reads the team's own job file
        audit = load_audit(tmp_path / f"{name}.yaml", text=starter_audit(registry, [name]))
        check_scenario(Scenario(audit), user_code=False)
        assert audit.settings[-1].name == name


def test_init_writes_the_file_and_refuses_to_overwrite_it(capsys, tmp_path):
    path = tmp_path / "noise.yaml"
    code, _, err = _run(capsys, "init", str(path), "--attack", "dlg")
    assert code == 0 and f"wrote {path}" in err
    audit = load_audit(path)
    assert audit.name == "noise" and [a.name for a in audit.attacks] == ["dlg"]
    assert main(["validate", str(path)]) == 0
    capsys.readouterr()
    code, _, err = _run(capsys, "init", str(path))
    assert code == 2 and err.strip() == f"leakaudit: error: init: {path} exists; pass --force to overwrite it"


def test_init_writes_the_plugins_dir_it_was_given_so_that_validate_finds_the_plugin(capsys, tmp_path):
    """``init --plugins-dir DIR`` names DIR in the file (relative to it): the suggested ``validate FILE``
    then finds the drop-in defense with no option."""
    folder = tmp_path / "my_plugins"
    folder.mkdir()
    template = Path(__file__).parents[1] / "examples" / "plugin-template" / "src" / "leakaudit_logistic"
    (folder / "logistic.py").write_text((template / "__init__.py").read_text())
    path = tmp_path / "audits" / "plug.yaml"
    path.parent.mkdir()
    code, _, err = _run(capsys, "init", str(path), "--defense", "logistic", "--plugins-dir", str(folder))
    assert code == 0 and f"`leakaudit validate {path}`" in err
    assert "plugins_dir: ../my_plugins" in path.read_text()
    assert main(["validate", str(path)]) == 0
    code, _, err = _run(capsys, "init", "--plugins-dir", str(folder), "--plugins-dir", str(tmp_path))
    assert code == 2 and err.strip() == ("leakaudit: error: init: --plugins-dir given 2 times; an audit file names "
                                         "one plugins_dir: put the plugins in one folder")


@pytest.mark.parametrize("option, name, start", [
    ("--defense", "gausian", "init: --defense 'gausian' is not a registered defense (did you mean 'gaussian'?); "
                             "choices: ats, bayesian,"),
    ("--attack", "bayse", "init: --attack 'bayse' is not a registered attack (did you mean 'bayes'?); "
                          "choices: adapter_span, analytic, ares, bayes,"),
])
def test_init_typo_is_one_line(capsys, option, name, start):
    code, out, err = _run(capsys, "init", option, name)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"leakaudit: error: {start}")


def test_schema_command_prints_the_registered_names(capsys):
    code, out, _ = _run(capsys, "schema")
    schema = json.loads(out)
    assert code == 0 and schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert "gaussian" in json.dumps(schema) and "inverting_gradients" in json.dumps(schema)


@pytest.mark.parametrize("name, line", [
    ("My-Noise", "new-plugin: 'My-Noise' is not a plugin name: lower-case letters, digits and underscores, "
                 "starting with a letter"),
    ("gaussian", "new-plugin: defense 'gaussian' is already registered by builtin:leakaudit.defenses.noise; "
                 "choose another name"),
])
def test_new_plugin_bad_names(capsys, tmp_path, name, line):
    code, _, err = _run(capsys, "new-plugin", name, "--dir", str(tmp_path))
    assert code == 2 and err.strip() == f"leakaudit: error: {line}" and not any(tmp_path.iterdir())


def _env_beside_this_one(folder: Path) -> Path:
    """A fresh virtual environment that also sees this one's packages (leakaudit, torch, pytest, pip): what a
    plugin author has after `pip install leakaudit`, so that an editable install lands in it alone."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_leakaudit_parent.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return python


@pytest.mark.heavy
def test_new_plugin_installs_is_listed_and_passes_its_own_tests(capsys, tmp_path):
    code, _, err = _run(capsys, "new-plugin", "soft_noise", "--dir", str(tmp_path))
    folder = tmp_path / "leakaudit-soft-noise"
    assert code == 0 and (folder / "src" / "leakaudit_soft_noise" / "__init__.py").is_file()
    assert f"pip install --no-build-isolation -e '{folder}[test]'" in err
    python = _env_beside_this_one(tmp_path / "env")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # as the message says, offline: its dependencies (leakaudit, pytest) are the environment's own
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-index", "-e",
                    f"{folder}[test]"], check=True, capture_output=True, env=env)
    listed = subprocess.run([python, "-m", "leakaudit", "plugins", "defense"], capture_output=True, text=True,
                            check=True, env=env).stdout
    assert any(line.split()[:3] == ["defense", "soft_noise", "entrypoint:soft_noise"] for line in listed.splitlines())
    tests = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], capture_output=True, text=True,
                           cwd=folder, env=env)
    assert tests.returncode == 0 and "5 passed" in tests.stdout, tests.stdout[-2000:]
    # editable: a change to the source shows at once
    module = folder / "src" / "leakaudit_soft_noise" / "__init__.py"
    module.write_text(module.read_text().replace('paper = ""', 'paper = "Doe et al. 2026"'))
    shown = subprocess.run([python, "-m", "leakaudit", "plugins", "defense", "soft_noise"], capture_output=True,
                           text=True, check=True, env=env).stdout
    assert "  paper:      Doe et al. 2026 (references: docs/references.md)" in shown.splitlines()


def test_the_example_plugin_is_what_new_plugin_writes(tmp_path):
    from leakaudit.evaluator.authoring.scaffold import write_plugin

    from conftest import ROOT

    written = write_plugin("logistic", tmp_path)
    example = ROOT / "examples" / "plugin-template"
    files = sorted(p.relative_to(written) for p in written.rglob("*") if p.is_file())
    built = {"__pycache__", "build", "leakaudit_logistic.egg-info"}  # what installing it leaves in the tree
    assert files == sorted(p.relative_to(example) for p in example.rglob("*")
                           if p.is_file() and not built.intersection(p.relative_to(example).parts))
    assert all((written / f).read_text() == (example / f).read_text() for f in files)


def test_plugins_kind_name_says_what_attacks_auto_does_with_it(capsys):
    _, out, _ = _run(capsys, "plugins", "attack", "learning_to_invert")
    assert ("  auto:     run by attacks: auto where it applies, at cpu: updates=2048, iterations=1500, width=500; "
            "cuda: its defaults") in out.splitlines()
    _, out, _ = _run(capsys, "plugins", "attack", "l2")
    assert "  auto:     left out of attacks: auto (bayes runs the matching adversary: l2 is its form for Gaussian noise)" \
        in out.splitlines()


def test_init_writes_a_text_audit_for_text_defenses_and_refuses_a_mix(registry, tmp_path):
    audit = load_audit(tmp_path / "text.yaml", text=starter_audit(registry, ["frozen_embeddings"]))
    assert audit.data.dataset == "pii_sentences" and audit.model.name == "tiny_gpt"
    assert [a.name for a in audit.attacks] == ["tag", "bayes_text", "adapter_span", "dager", "lamp", "token_set"]
    assert audit.metrics[0] == "rouge1"
    with pytest.raises(ConfigError, match=r"init: the defenses apply to different examples \(.*soteria: image\)"):
        starter_audit(registry, ["frozen_embeddings", "soteria"])
