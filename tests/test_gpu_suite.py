"""benchmarks/gpu_suite.py at toy sizes on the CPU: every section a lent GPU will run, so that none rots."""
from __future__ import annotations

import pytest
import importlib.util
import json

from conftest import ROOT


@pytest.mark.slow
def test_the_gpu_suite_runs_every_section_at_toy_sizes(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    assert suite.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert results["failed"] == {}
    assert set(results["sections"]) == {"throughput_lenet", "throughput_resnet18_224", "quickstart", "precision",
                                        "text_dager_scale", "text_tag_lamp", "text_quickstart", "text_keyboard",
                                        *(f"paper_{name}" for name in suite.PAPER_CASES)}
    text = results["sections"]["text_dager_scale"]
    assert [(row["setting"], row["rouge1"]) for row in text] == [("none", 1.0), ("lora(rank=8)", 0.0)]
    assert set(results["sections"]["text_tag_lamp"][0]["rouge2_by_attack"]) == {"tag", "lamp"}
    assert [row["K"] for row in results["sections"]["throughput_lenet"]] == [1, 2]
    assert all(row["image_iterations_per_s"] > 0 for row in results["sections"]["throughput_lenet"])
    assert all(results["sections"][f"paper_{name}"]["measured"] for name in suite.PAPER_CASES)
    assert [row["precision"] for row in results["sections"]["precision"]] == ["float32", "bfloat16"]
    assert "## quickstart" in (tmp_path / "gpu_suite.md").read_text()
