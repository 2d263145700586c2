"""The command line as people meet it: --help and --version never wait for torch, a closed pipe ends quietly,
the listing is aligned columns."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

PROBE = ("import sys\nfrom leakaudit.evaluator.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
         "print('IMPORTED:' + ','.join(m for m in ('torch', 'matplotlib', 'scipy', 'leakaudit.evaluator.run.runner') "
         "if m in sys.modules))")


def _imported(argv: list[str]) -> str:
    """The heavy modules a fresh interpreter has imported once ``leakaudit ARGV`` has answered."""
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, check=True)
    return next(line for line in done.stdout.splitlines() if line.startswith("IMPORTED:")).removeprefix("IMPORTED:")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["run", "--help"], ["validate", "--help"],
                                  ["plugins", "--help"], ["report", "--help"], ["frobnicate"]])
def test_help_version_and_usage_errors_import_no_torch(argv):
    assert _imported(argv) == ""


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly():
    """The schema (300 kB) outgrows a pipe's buffer, so its writes meet the closed pipe whatever the timing."""
    listing = subprocess.Popen([sys.executable, "-m", "leakaudit", "schema"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    listing.stdout.readline()
    listing.stdout.close()  # as `leakaudit schema | head -1` does
    err = listing.stderr.read().decode()
    assert listing.wait() == 141 and "Traceback" not in err and "BrokenPipe" not in err


@pytest.mark.slow
def test_the_listing_is_aligned_columns_people_read():
    done = subprocess.run([sys.executable, "-m", "leakaudit", "plugins"], capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["KIND", "NAME", "FROM", "PAPER", "WHAT", "IT", "IS"]
    starts = {line.index("builtin") for line in lines[1:] if "builtin" in line}
    assert len(starts) == 1  # one column for every row
    assert "``" not in done.stdout
    ats = next(line for line in lines if line.split()[:2] == ["defense", "ats"])
    assert ats.count("Gao et al. 2021") == 1  # the paper in its column, not again in the summary


@pytest.mark.slow
def test_validate_and_plugins_import_neither_the_runner_nor_matplotlib_nor_scipy():
    config = str(ROOT / "configs" / "quickstart.yaml")
    for argv in (["validate", config], ["plugins"]):
        assert _imported(argv) == "torch", argv


@pytest.mark.parametrize("argv", [["--debug", "validate", "missing.yaml"], ["validate", "missing.yaml", "--debug"]])
def test_debug_before_or_after_the_command_shows_the_traceback(argv, tmp_path, monkeypatch):
    from leakaudit.evaluator.cli import main
    from leakaudit.evaluator.audit.types import ConfigError

    monkeypatch.chdir(tmp_path)
    assert main(argv[:-1] if argv[-1] == "--debug" else argv[1:]) == 2  # without it: the one line
    with pytest.raises(ConfigError, match="file not found"):
        main(argv)
