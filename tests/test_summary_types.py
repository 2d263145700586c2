"""The typed summary reads summary.json back to the byte, older layouts too, and refuses a newer one."""
import json
from pathlib import Path

import pytest

from leakaudit.evaluator.results.types import SUMMARY_VERSION, Scores, Summary

STORED = Path(__file__).parent / "data" / "stored_run" / "summary.json"


def test_a_stored_summary_reads_back_to_the_same_file():
    text = STORED.read_text()
    summary = Summary.from_json(json.loads(text))
    assert json.dumps(summary.to_json(), indent=2) == text.rstrip("\n")


def test_the_typed_summary_answers_what_the_file_says():
    record = json.loads(STORED.read_text())
    summary = Summary.from_json(record)
    first = record["cells"][0]
    cell = summary.cell(first["setting"], first["attack"], first["checkpoint"])
    assert cell.mean("psnr") == first["psnr_mean"] and cell.scores["ssim"].n == first["ssim_n"]
    worst = summary.worst(record["worst_case"][0]["setting"])
    assert worst.ci("psnr") == record["worst_case"][0]["psnr_ci"]
    assert summary.leak_threshold.value == record["leak_threshold"]["value"]
    assert summary.verdict_options.bootstrap == record["verdict_options"]["bootstrap"]
    assert cell.mean("no_such_metric") is None and Scores().n == 0


def test_a_folder_from_before_the_layout_was_numbered_reads_as_version_1():
    record = json.loads(STORED.read_text())
    del record["version"]
    summary = Summary.from_json(record)
    assert summary.version == 1 and len(summary.cells) == len(record["cells"])


def test_a_newer_layout_is_refused_with_what_to_do():
    record = {**json.loads(STORED.read_text()), "version": SUMMARY_VERSION + 1}
    with pytest.raises(ValueError, match="upgrade leakaudit"):
        Summary.from_json(record)
