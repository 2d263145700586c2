"""Plugin discovery: built-ins, entry points, drop-in folders, clashes and broken plugins."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from leakaudit.plugins import PluginError
from leakaudit.plugins.manager import load_registry

from conftest import LEAKAUDIT, ROOT, small_audit

TEMPLATE = ROOT / "examples" / "plugin-template"


def test_builtins_register_through_the_hooks(registry):
    assert {"none", "gaussian"} <= set(registry.names("defense"))
    assert "inverting_gradients" in registry.names("attack")
    assert {"psnr", "ssim", "mse", "lpips", "label_accuracy"} <= set(registry.names("metric"))
    assert {"lenet_zhu", "convnet", "resnet18", "resnet20", "mlp"} <= set(registry.names("model"))
    assert {"digits", "lfw", "photos", "cifar10", "imagefolder"} <= set(registry.names("dataset"))
    assert registry.entries["defense"]["gaussian"].origin == "builtin:leakaudit.defenses.noise"


@pytest.mark.slow
def test_plugins_command_lists_every_kind_with_origin():
    proc = subprocess.run([*LEAKAUDIT, "plugins", "--json"], capture_output=True, text=True, check=True)
    entries = json.loads(proc.stdout)
    assert {e["kind"] for e in entries} == {"defense", "attack", "metric", "model", "dataset"}
    ig = next(e for e in entries if e["name"] == "inverting_gradients")
    assert ig["origin"] == "builtin:leakaudit.attacks.gradient_matching" and "Cosine" in ig["summary"]


def test_name_clash_names_both_plugins(tmp_path):
    (tmp_path / "clash.py").write_text(textwrap.dedent("""
        from leakaudit import hookimpl
        from leakaudit.defenses.noise import GaussianNoise

        class Mine(GaussianNoise):
            '''Another gaussian.'''

        @hookimpl
        def register_defenses():
            return [Mine]
    """))
    with pytest.raises(PluginError) as info:
        load_registry([tmp_path])
    msg = str(info.value)
    assert "'gaussian'" in msg and "builtin:leakaudit.defenses.noise" in msg and f"file:{tmp_path / 'clash.py'}" in msg


def test_broken_dropin_names_the_file(tmp_path):
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(PluginError, match=r"plugin file .*broken\.py failed to load: ModuleNotFoundError"):
        load_registry([tmp_path])


def test_unknown_hook_is_rejected(tmp_path):
    (tmp_path / "typo.py").write_text("from leakaudit import hookimpl\n\n@hookimpl\ndef register_defences():\n    return []\n")
    with pytest.raises(PluginError, match="register_defences"):
        load_registry([tmp_path])


def _run_template_audit(tmp_path, env, extra_args=()):
    audit = small_audit(defenses=[{"name": "logistic", "sweep": {"scale": [0.01, 10.0]}}], utility={"train_steps": 0})
    path = tmp_path / "logistic.yaml"
    path.write_text(json.dumps(audit))
    out = tmp_path / "out"
    subprocess.run([*LEAKAUDIT, "run", str(path), "--out", str(out), "--no-progress", *extra_args],
                   env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["setting"] for r in rows} == {"logistic(scale=0.01)", "logistic(scale=10.0)", "none"}  # and the reference
    return [r for r in rows if r["setting"] != "none"]


@pytest.mark.slow
def test_template_found_by_dropin_folder_and_runs_from_yaml(tmp_path):
    folder = tmp_path / "dropins"
    folder.mkdir()
    shutil.copy(TEMPLATE / "src" / "leakaudit_logistic" / "__init__.py", folder / "logistic.py")
    proc = subprocess.run([*LEAKAUDIT, "plugins", "--plugins-dir", str(folder)], capture_output=True, text=True,
                          check=True)
    assert any(line.split()[:3] == ["defense", "logistic", f"file:{folder / 'logistic.py'}"]
               for line in proc.stdout.splitlines())
    _run_template_audit(tmp_path, dict(os.environ), ["--plugins-dir", str(folder)])


@pytest.fixture(scope="module")
def template_env(tmp_path_factory):
    """The environment of a process that sees the template installed (into a folder of its own)."""
    site = tmp_path_factory.mktemp("template") / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(TEMPLATE)], check=True, capture_output=True)
    return {**os.environ, "PYTHONPATH": str(site)}


# slow: the template's own suite in a subprocess; the template is found and run by the tests below
@pytest.mark.heavy
def test_template_passes_its_own_tests(template_env, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TEMPLATE / "tests")],
                          env=template_env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0 and "5 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_template_installed_is_found_by_entry_point(tmp_path, template_env):
    env = template_env
    proc = subprocess.run([*LEAKAUDIT, "plugins"], capture_output=True, text=True, check=True, env=env)
    line = next(line for line in proc.stdout.splitlines() if line.split()[:2] == ["defense", "logistic"])
    assert "entrypoint:logistic (leakaudit-logistic)" in line
    rows = _run_template_audit(tmp_path, env)
    # strong logistic noise must hurt the attack more than weak noise
    weak = [r["psnr"] for r in rows if r["setting"] == "logistic(scale=0.01)"]
    strong = [r["psnr"] for r in rows if r["setting"] == "logistic(scale=10.0)"]
    assert sum(weak) > sum(strong)


@pytest.mark.slow
def test_dropin_named_in_the_file_and_on_the_command_line_reaches_worker_processes(tmp_path):
    folder = tmp_path / "plug"
    folder.mkdir()
    shutil.copy(TEMPLATE / "src" / "leakaudit_logistic" / "__init__.py", folder / "logistic.py")
    audit = small_audit(defenses=[{"name": "logistic", "params": {"scale": 0.01}}], utility={"train_steps": 0},
                        workers=2, plugins_dir="plug")
    path = tmp_path / "audit.yaml"
    path.write_text(json.dumps(audit))
    out = tmp_path / "out"
    subprocess.run([*LEAKAUDIT, "run", str(path), "--out", str(out), "--plugins-dir", str(folder), "--no-progress"],
                   check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["setting"] != "none"]  # the added reference
    assert sorted(r["target"] for r in rows) == [0, 1] and all(r["setting"] == "logistic(scale=0.01)" for r in rows)


def _origins(hint) -> set:
    """The runtime types a hint accepts at its top level: ``float | None`` -> {float, NoneType}."""
    import types
    import typing

    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return {typing.get_origin(a) or a for a in args}


def test_every_plugin_setting_is_a_typed_attribute(registry):
    """What ``params`` declares, the class annotates with the same type (None where it may be unset): a plugin
    author's checker and editor then know ``self.sigma`` is a float, as Opacus's and torchmetrics' attributes are."""
    import typing

    for kind in ("defense", "attack"):
        for name, entry in registry.entries[kind].items():
            hints = typing.get_type_hints(entry.obj)
            for key, param in entry.obj.params.items():
                assert key in hints, f"{kind} {name}: {key} is a parameter with no annotation on the class"
                declared = set(param.type if isinstance(param.type, tuple) else (param.type,))
                if param.items is not None:
                    declared.add(list)
                if param.nullable or (not param.required and param.default is None):
                    declared.add(type(None))
                assert _origins(hints[key]) == declared, f"{kind} {name}: {key}: {hints[key]} against {declared}"


def test_a_knob_declares_which_way_it_protects_in_one_of_two_words():
    """``Param(protects=...)`` takes "higher" or "lower" (what a frontier: search bisects on), and says so."""
    from leakaudit.plugins.spec import Param

    assert Param(0.1, float, protects="lower").protects == "lower"
    with pytest.raises(ValueError, match=r"^Param: protects is 'up'; choices: higher, lower \(or None\)$"):
        Param(0.1, float, protects="up")
