"""``leakaudit new-plugin NAME``: an installable plugin package with one defense, its likelihood and its tests."""
from __future__ import annotations

import re
from pathlib import Path

from leakaudit.plugins.manager import load_registry
from leakaudit.plugins.spec import PluginError


NAME = re.compile(r"[a-z][a-z0-9_]*")

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "leakaudit-{dist}"
version = "0.1.0"
description = "A leakaudit defense plugin: {name} (logistic noise on the shared update, with its likelihood)."
requires-python = ">=3.10"
# leakaudit is on no package index: install this into the environment that holds leakaudit (installed from its
# checkout or its wheel) with --no-build-isolation, and pip finds it there
dependencies = ["leakaudit"]

[project.optional-dependencies]
test = ["pytest>=7.4"]

# leakaudit loads every module of this entry-point group at start-up: `leakaudit plugins` lists what it found.
[project.entry-points.leakaudit]
{name} = "leakaudit_{name}"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
'''

MODULE = '''\
"""The {name} defense for leakaudit: i.i.d. logistic noise on every coordinate of the shared update.

Replace the noise with your defense; keep ``log_likelihood`` exactly the density of what ``perturb``
sends (up to a constant in the candidate), because the Bayes-optimal attacker maximises it.
``tests/`` checks the two against each other with ``leakaudit.testing.check_defense``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from leakaudit import Defense, Param, SharedUpdate, hookimpl


class {cls}(Defense):
    """Adds i.i.d. Logistic(0, scale) noise to every coordinate of the shared update."""

    name = "{name}"
    paper = ""  # the paper your defense comes from, as "Author et al. YEAR"; `leakaudit plugins` shows it
    params = {{"scale": Param(type=float, min=0.0, exclusive_min=True, example=0.1, help="scale of the logistic noise")}}

    def perturb(self, update: list[Tensor], generator: torch.Generator) -> list[Tensor]:
        """Every random number comes from ``generator``: the same seed sends the same update."""
        out = []
        for g in update:
            u = torch.rand(g.shape, generator=generator, device=g.device, dtype=g.dtype).clamp(1e-7, 1 - 1e-7)
            out.append(g + self.scale * (torch.log(u) - torch.log1p(-u)))
        return out

    def log_likelihood(self, observed: SharedUpdate, candidate: Sequence[Tensor]) -> Tensor:
        """The logistic log-density of the residuals, summed, up to a constant: -z - 2 softplus(-z)."""
        total = 0.0
        for o, c in zip(observed.tensors, candidate):
            z = (o - c) / self.scale
            total = total + (-z - 2 * F.softplus(-z)).sum()
        return total


@hookimpl
def register_defenses():
    return [{cls}]
'''

TESTS = '''\
"""The {name} defense: its likelihood describes what it sends, and leakaudit finds it and audits with it."""
import pytest

from leakaudit import load_audit, load_registry
from leakaudit.evaluator.cli import main
from leakaudit.testing import check_defense

from leakaudit_{name} import {cls}


@pytest.mark.parametrize("scale", [0.01, 1.0])
def test_likelihood_matches_what_is_sent(scale):
    check_defense({cls}(scale=scale))


def test_a_likelihood_of_the_wrong_scale_is_caught():
    class TooFlat({cls}):
        def log_likelihood(self, observed, candidate):
            return {cls}(scale=2 * self.scale).log_likelihood(observed, candidate)

    with pytest.raises(AssertionError, match="flatter than what share"):
        check_defense(TooFlat(scale=0.1))


def test_registered_through_the_entry_point():
    assert load_registry().entries["defense"]["{name}"].origin.startswith("entrypoint:{name} ")


def test_an_audit_file_uses_it(tmp_path):
    path = tmp_path / "audit.yaml"
    assert main(["init", str(path), "--defense", "{name}"]) == 0
    assert "{name}(scale=0.1)" in [s.key for s in load_audit(path).settings]
'''

README = '''\
# leakaudit-{dist}

A leakaudit plugin: the `{name}` defense (logistic noise on the shared update, with its log-likelihood, so
that the Bayes-optimal attacker can use it).

leakaudit is on no package index: install this package into the environment that holds leakaudit (installed
from its checkout, `pip install -e path/to/leakaudit`, or from its wheel), without build isolation, so that
pip uses that leakaudit and looks for none elsewhere:

```bash
pip install --no-build-isolation -e '.[test]'   # registers the entry point
leakaudit plugins defense {name}     # its parameters, paper and origin
pytest                              # check_defense: share() against log_likelihood()
leakaudit init audit.yaml --defense {name} && leakaudit run audit.yaml --out runs/{name}
```

Replace the noise in `src/leakaudit_{name}/__init__.py` with your defense and keep its `log_likelihood`
the density of what `perturb` sends; the tests say what disagrees when it is not. How it plugs in:
`pyproject.toml` declares the entry point (group `leakaudit`), the module implements the
`register_defenses` hook, and `params` declares the YAML parameters, checked before any work.

Without installing, copy the module into a folder and pass `--plugins-dir FOLDER` (or `plugins_dir:`
in the audit file).
'''


def write_plugin(name: str, parent: Path) -> Path:
    """Write ``leakaudit-<name>/`` under ``parent`` and return it; PluginError for a bad or taken name."""
    if not NAME.fullmatch(name):
        raise PluginError(f"new-plugin: {name!r} is not a plugin name: lower-case letters, digits and underscores, "
                          "starting with a letter")
    taken = load_registry().entries["defense"].get(name)
    if taken is not None:
        raise PluginError(f"new-plugin: defense {name!r} is already registered by {taken.origin}; choose another name")
    dist = name.replace("_", "-")
    folder = parent / f"leakaudit-{dist}"
    if folder.exists():
        raise PluginError(f"new-plugin: {folder} exists; choose another name or --dir")
    cls = "".join(part.capitalize() for part in name.split("_")) + "Defense"
    fields = {"name": name, "dist": dist, "cls": cls}
    files = {"pyproject.toml": PYPROJECT, "README.md": README, f"src/leakaudit_{name}/__init__.py": MODULE,
             f"tests/test_{name}.py": TESTS}
    for relative, template in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**fields))
    return folder
