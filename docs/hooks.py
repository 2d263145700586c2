"""mkdocs hook: the reference pages generated from the code (docs/gen_reference.py) join the site's files."""
from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).parent))
import gen_reference  # noqa: E402  (docs/ is not a package)


def on_files(files: Files, config) -> Files:
    for path, text in gen_reference.pages().items():
        files.append(File.generated(config, path, content=text))
    return files
