"""Models of the zoo and offline datasets: shapes, initialisation, determinism, clear errors."""
from __future__ import annotations

import os

import pytest
import torch

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.zoo import datasets
from leakaudit.evaluator.zoo.models import ZOO, build_model

from conftest import small_audit


@pytest.mark.parametrize("spec", ZOO, ids=lambda s: s.name)
def test_zoo_models_classify_32px_images(spec):
    model = build_model(spec, {"channels": 3, "num_classes": 10, "image_size": 32}, {}, seed=0)
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)


def test_lenet_zhu_is_the_dlg_network():
    model = build_model(ZOO[0], {"channels": 3, "num_classes": 10, "image_size": 32}, {}, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 3 * 12 * 25 + 12 + 2 * (12 * 12 * 25 + 12) + 768 * 10 + 10
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert -0.5 <= flat.min() and flat.max() <= 0.5
    assert flat.std().item() == pytest.approx(12 ** -0.5, abs=0.01)  # U(-0.5, 0.5) weights and biases
    assert sum(isinstance(m, torch.nn.Sigmoid) for m in model.modules()) == 3


def test_resnets_take_the_imagenet_stem_above_64_px_and_any_activation():
    """Geiping et al. (2020) attack ImageNet-size ResNets with the ImageNet stem; Zhang et al. (2023) a sigmoid one."""
    from leakaudit.evaluator.zoo.models import resnet18, resnet34, resnet50

    small, large, forced = resnet18(3, 10, 32), resnet18(3, 10, 128), resnet18(1, 10, 32, stem="imagenet")
    assert small.conv1.kernel_size == (3, 3) and small.conv1.stride == (1, 1)
    assert isinstance(small.maxpool, torch.nn.Identity)
    assert large.conv1.kernel_size == (7, 7) and large.conv1.stride == (2, 2)
    assert isinstance(large.maxpool, torch.nn.MaxPool2d)
    assert forced.conv1.kernel_size == (7, 7) and forced.conv1.in_channels == 1
    assert large(torch.rand(1, 3, 128, 128)).shape == (1, 10)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert (count(resnet18(3, 1000, 224)), count(resnet34(3, 1000, 224)), count(resnet50(3, 1000, 224))) == (
        11_689_512, 21_797_672, 25_557_032)  # torchvision's ImageNet ResNets
    sigmoid = resnet18(3, 10, 32, activation="sigmoid")
    assert not any(isinstance(m, torch.nn.ReLU) for m in sigmoid.modules())
    assert sum(isinstance(m, torch.nn.Sigmoid) for m in sigmoid.modules()) == 9  # stem, one per block (used twice)
    convnet = build_model(next(s for s in ZOO if s.name == "convnet"), {"channels": 3, "num_classes": 10, "image_size": 32},
                          {"width": 8, "activation": "sigmoid"}, seed=0)
    assert sum(isinstance(m, torch.nn.Sigmoid) for m in convnet.modules()) == 8


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (build_model(ZOO[0], {"channels": 1, "num_classes": 10, "image_size": 16}, {}, seed=s) for s in (5, 5, 6))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_user_factory_gets_the_arguments_it_accepts():
    model = build_model("torch.nn:Linear", {"channels": 1, "num_classes": 10, "image_size": 4}, {"in_features": 5, "out_features": 2}, seed=0)
    assert isinstance(model, torch.nn.Linear) and model.out_features == 2
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        build_model("builtins:dict", {"channels": 1, "num_classes": 10, "image_size": 4}, {}, seed=0)


@pytest.mark.parametrize("loader, channels, classes", [
    (datasets.load_digits, 1, 10), (datasets.load_lfw, 1, 2), (datasets.load_photos, 3, 7)])
def test_offline_datasets(loader, channels, classes):
    data = loader(image_size=24)
    assert data.train_x.shape[1:] == (channels, 24, 24) and data.channels == channels
    assert 0 <= data.train_x.min() and data.train_x.max() <= 1
    assert data.num_classes == classes and set(data.train_y.unique().tolist()) == set(range(classes))
    assert len(data.test_x) > 0 and data.mean.shape == (channels,)
    again = loader(image_size=24)
    assert torch.equal(data.test_x, again.test_x)


@pytest.mark.skipif(datasets.foolbox_data_dir() is None, reason="the foolbox wheel's images: leakaudit fetch-data")
def test_real_cifar10_samples_from_the_foolbox_wheel():
    data = datasets.BUILTIN[3].load(image_size=32)
    assert data.name == "cifar10_samples" and data.train_x.shape == (10, 3, 32, 32) and len(data.test_x) == 10
    assert data.test_y.max() < 10 and data.train_x.std() > 0.1


def test_missing_foolbox_is_one_clear_line(monkeypatch, write_audit):
    monkeypatch.setattr(datasets, "foolbox_data_dir", lambda: None)
    path = write_audit(small_audit(data={"dataset": "mnist_samples"}))
    with pytest.raises(ConfigError) as info:
        load_audit(path)
    assert info.value.lines == [f"{path}: the *_samples datasets read the test images shipped in the foolbox wheel, "
                                "which are not fetched; run: leakaudit fetch-data"]


def _write_idx(path, array) -> None:
    """``array`` (unsigned bytes) as a gzipped idx file, LeCun's format that Debian's Fashion-MNIST ships."""
    import gzip

    import numpy as np

    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def test_fashion_mnist_reads_debians_idx_files_without_root(tmp_path, monkeypatch):
    import numpy as np

    rng = np.random.default_rng(0)
    for part, n in (("train", 30), ("test", 12)):
        images, labels = datasets.FASHION_FILES[part]
        _write_idx(tmp_path / images, rng.integers(0, 256, (n, 28, 28)))
        _write_idx(tmp_path / labels, np.arange(n) % 10)
    monkeypatch.setattr(datasets, "FASHION_DIR", tmp_path)
    spec = next(s for s in datasets.BUILTIN if s.name == "fashion_mnist")
    assert spec.check({}) == []
    data = spec.load(image_size=16, max_train=20)
    assert data.train_x.shape == (20, 1, 16, 16) and data.test_x.shape == (12, 1, 16, 16) and data.num_classes == 10
    assert 0 <= data.train_x.min() and data.train_x.max() <= 1 and data.test_y.tolist() == list(range(10)) + [0, 1]
    full = datasets.read_idx(tmp_path / datasets.FASHION_FILES["test"][0])
    assert torch.allclose(spec.load(image_size=28).test_x[:, 0], torch.tensor(full / 255.0, dtype=torch.float32))
    (tmp_path / datasets.FASHION_FILES["test"][1]).write_bytes(b"not gzip")
    with pytest.raises(OSError):
        spec.load(image_size=16)


def test_missing_fashion_mnist_says_how_to_install_it_in_one_line(tmp_path, monkeypatch, write_audit):
    monkeypatch.setattr(datasets, "FASHION_DIR", tmp_path / "absent")
    path = write_audit(small_audit(data={"dataset": "fashion_mnist", "targets": 2}))
    with pytest.raises(ConfigError) as info:
        load_audit(path)
    assert info.value.lines == [f"{path}: data.dataset: fashion_mnist reads Debian's files in {tmp_path / 'absent'}, "
                                "which has no train-images-idx3-ubyte.gz; install them with: apt-get install -y "
                                "dataset-fashion-mnist (or set root: to a torchvision FashionMNIST folder)"]


@pytest.mark.skipif(not (datasets.FASHION_DIR / "t10k-images-idx3-ubyte.gz").is_file(),
                    reason="Debian's dataset-fashion-mnist is not installed (.ci/run installs it)")
def test_real_fashion_mnist_from_debians_package():
    data = next(s for s in datasets.BUILTIN if s.name == "fashion_mnist").load(image_size=16, max_train=500,
                                                                              max_test=100)
    assert data.train_x.shape == (500, 1, 16, 16) and len(data.test_x) == 100
    assert set(data.train_y.unique().tolist()) == set(range(10)) and 0.2 < data.train_x.mean() < 0.4


def test_imagefolder_reads_a_local_folder(tmp_path):
    from PIL import Image

    for split in ("train", "test"):
        for cls, value in (("dark", 20), ("light", 230)):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (20, 20), (value + i, value, value)).save(tmp_path / split / cls / f"{i}.png")
    spec = next(s for s in datasets.BUILTIN if s.name == "imagefolder")
    assert spec.check({"root": str(tmp_path)}) == []
    data = spec.load(image_size=16, root=str(tmp_path))
    assert data.train_x.shape == (6, 3, 16, 16) and data.num_classes == 2
    assert data.train_x[data.train_y == 1].mean() > 0.8 > 0.2 > data.train_x[data.train_y == 0].mean()


def test_cnn_bayes_has_flax_default_initialisation():
    from leakaudit.evaluator.zoo.models import cnn_bayes

    torch.manual_seed(0)
    model = cnn_bayes(1, 10, 28)
    dense = model[7]
    assert dense.in_features == 3136 and dense.out_features == 100  # 'SAME' convolutions (the paper's flax code)
    assert dense.weight.std().item() == pytest.approx(3136 ** -0.5, rel=0.02)  # variance 1/fan_in
    assert dense.weight.abs().max().item() <= 2 * 3136 ** -0.5 / 0.8796 + 1e-6  # truncated at 2 std
    assert all(m.bias.abs().sum() == 0 for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)))


def test_process_flags_on_cuda_only_and_only_when_asked(monkeypatch):
    """CUDA's fast kernels are not bit-reproducible (two H100 runs differed by 0.8 dB per image): an audit on
    CUDA asks for deterministic cuDNN and cuBLAS kernels unless it sets deterministic: false."""
    from types import SimpleNamespace

    from leakaudit.evaluator.run.scenario import process_flags

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        process_flags(SimpleNamespace(device="cpu", deterministic=True, compile=False, precision="float32"))
        assert not torch.backends.cudnn.benchmark or before[3]
        process_flags(SimpleNamespace(device="cuda", deterministic=False, compile=False, precision="float32"))
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        assert torch.backends.cudnn.benchmark  # free to choose kernels: cuDNN times them and keeps the fastest
        restore = process_flags(SimpleNamespace(device="cuda", deterministic=True, compile=False, precision="float32"))
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        restore()  # run_audit restores them when it ends: the caller's own code is not left deterministic
        assert torch.are_deterministic_algorithms_enabled() == before[0]
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def test_a_cpu_audit_restores_no_flag_it_left_alone(monkeypatch):
    """Setting the deterministic flag imports torch's compiler (1.3 s): a CPU run's end leaves it as it found it."""
    from types import SimpleNamespace

    from leakaudit.evaluator.run.scenario import process_flags

    restore = process_flags(SimpleNamespace(device="cpu", deterministic=True, compile=False, precision="float32"))
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *a, **k: pytest.fail("set again"))
    restore()


def test_process_flags_compile_the_steps_only_when_asked_and_restore(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from leakaudit.attacks import vectorised
    from leakaudit.evaluator.run.scenario import process_flags

    monkeypatch.setenv("LEAKAUDIT_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    process_flags(SimpleNamespace(device="cpu", deterministic=True, compile=False, precision="float32"))()
    assert not vectorised._COMPILE and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    restore = process_flags(SimpleNamespace(device="cpu", deterministic=True, compile=True, precision="float32"))
    assert vectorised._COMPILE and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert not vectorised._CUDA_GRAPHS  # graphs are CUDA's
    restore()
    assert not vectorised._COMPILE
    restore = process_flags(SimpleNamespace(device="cuda", deterministic=True, compile=True, precision="float32"))
    assert vectorised._COMPILE and vectorised._CUDA_GRAPHS
    restore()
    assert not vectorised._COMPILE and not vectorised._CUDA_GRAPHS
    process_flags(SimpleNamespace(device="cuda", deterministic=True, compile=False, precision="float32"))()
    assert not vectorised._CUDA_GRAPHS  # no graphs without compiling


def test_targets_can_be_the_first_training_images_and_are_then_never_tuned_on(write_audit):
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.scenario import Scenario

    from conftest import small_audit

    audit = load_audit(write_audit(small_audit(data={
        "dataset": "digits", "image_size": 16, "targets": 6, "batch_size": 2, "target_split": "train",
        "target_order": "first"})))
    scenario = Scenario(audit)
    assert scenario.target_indices.tolist() == [0, 1, 2, 3, 4, 5]
    x, y = scenario.target_batch(1)
    assert torch.equal(x, scenario.data.train_x[2:4]) and torch.equal(y, scenario.data.train_y[2:4])
    assert not set(scenario.tuning_indices.tolist()) & set(range(6))
    assert len(scenario.tuning_indices) == len(scenario.data.train_x) - 6
    drawn = Scenario(load_audit(write_audit(small_audit(), "drawn.yaml")))
    assert drawn.target_indices.tolist() != list(range(len(drawn.target_indices)))  # the default: a seeded draw
    assert len(drawn.tuning_indices) == len(drawn.data.train_x)


def test_a_search_with_no_training_image_left_to_tune_on_is_refused_before_work(write_audit):
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.audit.types import ConfigError
    from leakaudit.evaluator.run.scenario import Scenario, check_scenario

    from conftest import small_audit

    tuned = {"name": "bayes", "params": {"iterations": 2}, "tune": {"budget": 2, "space": {"lr": [0.1]}, "targets": 2}}
    data = {"dataset": "mnist_samples", "image_size": 28, "targets": 9, "batch_size": 1, "target_split": "train",
            "target_order": "first"}
    path = write_audit(small_audit(data=data, attacks=[tuned], model={"name": "cnn_bayes"}))
    with pytest.raises(ConfigError) as info:
        check_scenario(Scenario(load_audit(path)))
    assert info.value.lines == [f"{path}: attacks[0].tune.targets: 2 tuning batches of 1 need 2 training images; "
                                "1 are left to tune on (9 are targets: data.target_split is train); lower "
                                "tune.targets or data.targets"]
    check_scenario(Scenario(load_audit(write_audit(small_audit(data={**data, "targets": 8}, attacks=[tuned],
                                                               model={"name": "cnn_bayes"}), "fits.yaml"))))
