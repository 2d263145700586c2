"""What the docs show is what the code takes: every audit file in README.md and docs/ validates as written, and a
fragment of one names only keys an audit file has."""
from __future__ import annotations

import re
import shutil

import pytest
import yaml

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.specs import TOP

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page, i, block) for page in PAGES
          for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S))]


def test_the_docs_hold_yaml_blocks():
    assert {p.name for p, _, _ in BLOCKS} >= {"audit-file.md", "own-training.md", "cluster.md"}


def test_readme_is_what_a_visitor_needs_and_links_every_page():
    """README.md stays short (what it is, the two commands, the quickstart's output, links); the reference lives
    in docs/, each page linked from it."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 10_000
    assert all(f"docs/{page.name}" in readme for page in (ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{p.name}[{i}]" for p, i, _ in BLOCKS])
def test_every_yaml_block_of_the_docs_validates(tmp_path, page, index, block):
    content = yaml.safe_load(block)
    assert isinstance(content, dict) and set(content) <= set(TOP), f"{page.name}: unknown keys {set(content) - set(TOP)}"
    if not {"name", "defenses"} <= set(content):
        return  # a fragment: its keys are an audit file's
    (tmp_path / "my_plugins").mkdir()
    for module in (ROOT / "examples" / "own_training").glob("*.py"):  # the factories the pages name
        shutil.copy(module, tmp_path)
    path = tmp_path / "audit.yaml"
    path.write_text(block)
    audit = load_audit(path, import_user_code=False)
    assert audit.settings and audit.attacks
