"""The CUDA code paths, run on a CPU with CUDA's calls faked: every place that picks a device, a generator, the
memory or a GPU per worker, so that the first run on a GPU meets no AttributeError. The figures of a real GPU
come from benchmarks/, on a machine that has one."""
from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

import pytest
import torch

from leakaudit.attacks import vectorised
from leakaudit.evaluator.audit.checks import check_device, check_precision
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.run import executors
from leakaudit.evaluator.run.runner import run_info
from leakaudit.evaluator.run.scenario import Scenario
from leakaudit.evaluator.zoo.models import mlp

from conftest import small_audit

CUDA = torch.device("cuda")


@pytest.fixture
def three_gpus(monkeypatch):
    """A machine that reports three CUDA devices; what was asked of them is recorded."""
    asked: dict[str, list] = {"set_device": [], "mem_get_info": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: asked["set_device"].append(index))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake H100")
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: asked["mem_get_info"].append(device) or (40 << 30, 80 << 30))
    return asked


def test_device_auto_picks_cuda_where_it_is_available_and_one_worker_per_gpu(three_gpus, write_audit):
    assert check_device("auto", []) == "cuda"
    audit = small_audit(device="auto")
    del audit["workers"]
    loaded = load_audit(write_audit(audit))
    assert loaded.device == "cuda" and loaded.workers == 3 and loaded.executor.num_gpus == 1.0


def test_cuda_refused_where_there_is_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    problems: list[str] = []
    assert check_device("cuda", problems) == "cuda"
    assert problems == ["device: 'cuda' but no CUDA device is available here; choices: auto, cpu, cuda"]


def test_free_memory_on_cuda_is_the_devices_own_count(three_gpus):
    assert vectorised.free_memory(CUDA) == 40 << 30 and three_gpus["mem_get_info"] == [CUDA]


def test_chunk_size_on_cuda_fills_the_free_memory_whatever_the_model_size(three_gpus, monkeypatch):
    """On a CPU a model above CPU_MAX_PARAMETERS runs one problem at a time; on a GPU the batched kernels are
    what the device is for, so only its free memory bounds the chunk."""
    monkeypatch.setattr(vectorised, "problem_footprint", lambda threat, images: 1 << 30)  # 1 GiB a problem
    big = mlp(3, 10, 32, width=512, depth=1)
    assert sum(p.numel() for p in big.parameters()) > vectorised.CPU_MAX_PARAMETERS
    on_gpu, on_cpu = SimpleNamespace(model=big, device=CUDA), SimpleNamespace(model=big, device=torch.device("cpu"))
    assert vectorised.chunk_size(None, on_gpu, 1, 1000) == int(vectorised.MEMORY_SHARE * 40)
    assert vectorised.chunk_size(None, on_cpu, 1, 1000) == 1
    assert vectorised.chunk_size(7, on_gpu, 1, 1000) == 7


def test_each_worker_process_takes_the_next_gpu(three_gpus, write_audit, tmp_path, monkeypatch):
    """As a spawned worker would, in this process: its deterministic kernels are switched on, so the test puts
    this process's flags back afterwards."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the test process keeps its threads
    monkeypatch.setattr(executors, "_PROCESS_WORKER", None)  # put back at teardown
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored at teardown
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    path = write_audit(small_audit(device="cuda"))
    started = multiprocessing.get_context("spawn").Value("i", 0)
    try:
        for _ in range(4):
            executors._init_process(str(path), [], str(tmp_path / "out"), 1, started)
        assert torch.are_deterministic_algorithms_enabled()  # deterministic: true on CUDA
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert three_gpus["set_device"] == [0, 1, 2, 0]
    assert executors._PROCESS_WORKER.scenario.device == CUDA


def test_run_info_names_the_gpu_and_keeps_determinism_as_asked(three_gpus, write_audit):
    for deterministic in (True, False):
        audit = load_audit(write_audit(small_audit(device="cuda", deterministic=deterministic)))
        info = run_info(Scenario(audit), 3)
        assert info["device"] == "cuda: Fake H100 x 3 process(es)" and info["device_type"] == "cuda"
        assert info["deterministic"] is deterministic


def test_bfloat16_on_a_gpu_without_it_is_refused_in_one_line(monkeypatch):
    """Autocast to bfloat16 on a GPU that lacks its arithmetic would be emulated: slower than float32."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    problems: list[str] = []
    # torch counts an emulated bfloat16 as supported (a V100's): only the card's own arithmetic counts here
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    check_precision("bfloat16", "cuda", problems)
    check_precision("float32", "cuda", problems)
    assert problems == []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    check_precision("bfloat16", "cuda", problems)
    check_precision("bfloat16", "cpu", problems)  # allowed on a CPU: a speed check there is the user's call
    assert problems == ["precision: bfloat16 but Tesla V100 has no bfloat16 arithmetic; choices: float32, "
                        "bfloat16 (on a GPU that has it)"]
