"""What each command imports before it answers: --help and --version never wait for torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = ("import sys\nfrom leakaudit.evaluator.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
         "print(','.join(m for m in ('torch', 'matplotlib', 'leakaudit.evaluator.runner') if m in sys.modules))")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["run", "--help"], ["validate", "--help"],
                                  ["plugins", "--help"], ["report", "--help"], ["frobnicate"]])
def test_help_version_and_usage_errors_import_no_torch(argv):
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == ""


def test_a_closed_pipe_ends_quietly():
    listing = subprocess.Popen([sys.executable, "-m", "leakaudit", "plugins"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    listing.stdout.readline()
    listing.stdout.close()  # as `leakaudit plugins | head -1` does
    err = listing.stderr.read().decode()
    assert listing.wait() in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err
