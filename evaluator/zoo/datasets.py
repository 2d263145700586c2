"""Image datasets: offline built-ins first, torchvision sets from a local ``root:`` folder."""
from __future__ import annotations

import gzip
import importlib.util
import math
import re
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from leakaudit.evaluator.zoo import gcompris
from leakaudit.evaluator.zoo.shipped import shipped
from leakaudit.plugins import Param, hookimpl
from leakaudit.plugins.components import DatasetSpec, ImageData

SPLIT_SEED = 20240611  # fixed: train/test splits never depend on the audit seed




def resize(images: Tensor, size: int) -> Tensor:
    """Square-resize a batch (N, C, H, W) with antialiasing."""
    if images.shape[-2:] == (size, size):
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False).clamp(0, 1)


def split(name: str, x: Tensor, y: Tensor, num_classes: int, test_fraction: float = 0.2) -> ImageData:
    """A fixed shuffled train/test split."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = max(1, int(round(len(x) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    return ImageData(name, x[train], y[train], x[test], y[test], num_classes)


def load_digits(image_size: int, **_: Any) -> ImageData:
    """scikit-learn's 1797 handwritten digits (8x8, greyscale), upsampled."""
    images, target = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    return split("digits", resize(x, image_size), torch.tensor(target), 10)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' (1797, 8, 8) images and labels, read from the file scikit-learn ships without importing
    scikit-learn (0.4 s an audit need not wait for); through its loader where its layout differs."""
    spec = importlib.util.find_spec("sklearn")
    shipped = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" \
        if spec and spec.submodule_search_locations else None
    if shipped is None or not shipped.is_file():
        from sklearn.datasets import load_digits as sk_digits

        d = sk_digits()
        return d.images, d.target
    data = np.loadtxt(shipped, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def load_lfw(image_size: int, **_: Any) -> ImageData:
    """scikit-image's LFW subset: 100 faces (label 1) and 100 non-faces (label 0), 25x25 greyscale."""
    from skimage import data

    x = torch.tensor(data.lfw_subset(), dtype=torch.float32).unsqueeze(1)
    y = torch.cat([torch.ones(100, dtype=torch.long), torch.zeros(100, dtype=torch.long)])
    return split("lfw", resize(x, image_size), y, 2)


PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "retina", "immunohistochemistry")


def load_photos(image_size: int, crops: int = 64, **_: Any) -> ImageData:
    """Random square crops of scikit-image's seven colour photographs; the label is the photograph."""
    from skimage import data

    gen = torch.Generator().manual_seed(SPLIT_SEED)
    xs, ys = [], []
    for label, photo in enumerate(PHOTOS):
        img = torch.tensor(getattr(data, photo)(), dtype=torch.float32).permute(2, 0, 1) / 255.0
        h, w = img.shape[1:]
        for _crop in range(crops):
            side = int(torch.randint(min(h, w) // 8, min(h, w) // 3 + 1, (1,), generator=gen))
            top = int(torch.randint(0, h - side + 1, (1,), generator=gen))
            left = int(torch.randint(0, w - side + 1, (1,), generator=gen))
            xs.append(resize(img[None, :, top:top + side, left:left + side], image_size)[0])
            ys.append(label)
    return split("photos", torch.stack(xs), torch.tensor(ys), len(PHOTOS))


FOOLBOX_SETS = {"cifar10_samples": ("cifar10", 10), "cifar100_samples": ("cifar100", 100),
                "mnist_samples": ("mnist", 10), "fashion_mnist_samples": ("fashionMNIST", 10)}


def foolbox_data_dir() -> Path | None:
    """The ``foolbox/data`` folder of the foolbox wheel: fetched by ``leakaudit fetch-data`` (shipped.py), or in
    an installed copy, found without importing foolbox."""
    return shipped("foolbox", "data")


def _check_foolbox(_: dict[str, Any]) -> list[str]:
    if foolbox_data_dir() is None:
        return ["the *_samples datasets read the test images shipped in the foolbox wheel, which are not "
                "fetched; run: leakaudit fetch-data"]
    return []


def _foolbox_loader(name: str) -> Callable[..., ImageData]:
    prefix, classes = FOOLBOX_SETS[name]

    def load(image_size: int, **_: Any) -> ImageData:
        from PIL import Image

        folder = foolbox_data_dir()
        assert folder is not None, "_check_foolbox refused the audit without it"
        files = sorted(folder.glob(f"{prefix}_*.png"))
        pattern = re.compile(rf"{prefix}_(\d+)_(\d+)\.png")
        xs, ys = [], []
        for f in files:
            m = pattern.fullmatch(f.name)
            if not m:
                continue
            arr = np.asarray(Image.open(f), dtype=np.float32) / 255.0
            t = torch.tensor(arr)
            xs.append(t.permute(2, 0, 1) if t.dim() == 3 else t[None])
            ys.append(int(m.group(2)))
        return split(name, resize(torch.stack(xs), image_size), torch.tensor(ys), classes, test_fraction=0.5)

    load.__doc__ = f"The first 20 test images of the real {prefix} set, shipped in the foolbox wheel (10 train, 10 test)."
    return load


TORCHVISION_SETS = {"cifar10": "CIFAR10", "cifar100": "CIFAR100", "mnist": "MNIST", "fashion_mnist": "FashionMNIST"}
TORCHVISION_FILES = {"cifar10": "cifar-10-batches-py/", "cifar100": "cifar-100-python/",
                     "mnist": "MNIST/raw/", "fashion_mnist": "FashionMNIST/raw/"}


def _check_root(name: str) -> Callable[[dict[str, Any]], list[str]]:
    """The check of ``data.root`` before any work: what to put where, and a hint that works (imagefolder reads
    the user's own folders, so it never downloads)."""
    own = name not in TORCHVISION_FILES
    where = "train/<class>/ and test/<class>/ (image files, one subfolder per class)" if own else TORCHVISION_FILES[name]
    fetch = "" if own else ", or set download: true"

    def check(section: dict[str, Any]) -> list[str]:
        root = section.get("root")
        if own and section.get("download"):
            return [f"data.download: dataset {name!r} reads your own folders and has nothing to download; remove "
                    f"download: true and put {where} under root"]
        if root is None:
            return [f"data.root: dataset {name!r} needs a root folder; set root: to a folder"
                    + (f" holding {where}" if own else " (with download: true to fetch it there)")]
        if section.get("download"):
            return []
        if not Path(root).is_dir():
            return [f"data.root: folder {root} does not exist; put {where} there{fetch}"]
        needed = ["train/", "test/"] if own else [TORCHVISION_FILES[name]]
        missing = [n for n in needed if not (Path(root) / n).is_dir()]
        if missing:
            return [f"data.root: folder {root} has no {' or '.join(missing)}; put {where} there{fetch}"]
        return []
    return check


def _as_tensors(dataset, limit: int) -> tuple[Tensor, Tensor]:
    n = min(limit, len(dataset))
    gen = torch.Generator().manual_seed(SPLIT_SEED)
    idx = sorted(torch.randperm(len(dataset), generator=gen)[:n].tolist())  # kept in the dataset's own order
    xs, ys = zip(*(dataset[i] for i in idx))
    return torch.stack(xs), torch.tensor(ys)


def _torchvision_loader(name: str) -> Callable[..., ImageData]:
    def load(image_size: int, root: str, download: bool = False, max_train: int = 10000,
             max_test: int = 2000, **_: Any) -> ImageData:
        import torchvision
        from torchvision import transforms

        tf = transforms.Compose([transforms.Resize((image_size, image_size)), transforms.ToTensor()])
        if name == "imagefolder":
            train = torchvision.datasets.ImageFolder(str(Path(root) / "train"), transform=tf)
            test = torchvision.datasets.ImageFolder(str(Path(root) / "test"), transform=tf)
            classes = len(train.classes)
        else:
            cls = getattr(torchvision.datasets, TORCHVISION_SETS[name])
            train = cls(root, train=True, transform=tf, download=download)
            test = cls(root, train=False, transform=tf, download=download)
            classes = len(train.classes)
        (trx, try_), (tex, tey) = _as_tensors(train, max_train), _as_tensors(test, max_test)
        return ImageData(name, trx, try_, tex, tey, classes)

    load.__doc__ = (f"torchvision's {TORCHVISION_SETS.get(name, 'ImageFolder')} read from root: "
                    + ("(train/ and test/ folders of class subfolders)" if name == "imagefolder"
                       else "(download only with download: true)"))
    return load


#: Where Debian's package dataset-fashion-mnist puts Fashion-MNIST's original idx files (Xiao et al. 2017).
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                 "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
FASHION_INSTALL = "apt-get install -y dataset-fashion-mnist"


def read_idx(path: Path) -> np.ndarray:
    """One gzipped idx file (LeCun's format: magic 0x0000 0x08 ndim, big-endian sizes, unsigned bytes) as an array."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[:3] != b"\0\0\x08":
        raise ValueError(f"{path} is not an idx file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(shape):
        raise ValueError(f"{path} holds {data.size} values, not the {math.prod(shape)} its header says")
    return data.reshape(shape)


def _fashion_split(part: str, limit: int, image_size: int) -> tuple[Tensor, Tensor]:
    """``limit`` images of one of Debian's Fashion-MNIST splits (a fixed seeded subset, in file order), resized."""
    images, labels = (read_idx(FASHION_DIR / f) for f in FASHION_FILES[part])
    n = min(limit, len(images))
    idx = torch.randperm(len(images), generator=torch.Generator().manual_seed(SPLIT_SEED))[:n].sort().values.numpy()
    x = torch.from_numpy(images[idx].astype(np.float32) / 255.0).unsqueeze(1)
    return resize(x, image_size), torch.from_numpy(labels[idx].astype(np.int64))


def load_fashion_mnist(image_size: int, root: str | None = None, download: bool = False, max_train: int = 10000,
                       max_test: int = 2000, **params: Any) -> ImageData:
    """Fashion-MNIST (Xiao et al. 2017: 70,000 greyscale 28x28 photographs of clothes, 10 classes): Debian's
    dataset-fashion-mnist files without root:, torchvision's FashionMNIST from a root: folder."""
    if root is not None:
        return _torchvision_loader("fashion_mnist")(image_size, root, download, max_train, max_test, **params)
    (trx, try_), (tex, tey) = _fashion_split("train", max_train, image_size), _fashion_split("test", max_test, image_size)
    return ImageData("fashion_mnist", trx, try_, tex, tey, 10)


def _check_fashion(section: dict[str, Any]) -> list[str]:
    """Debian's files where no root: is set (one line saying how to install them), else the root: folder's."""
    if section.get("root") is not None:
        return _check_root("fashion_mnist")(section)
    missing = [f for pair in FASHION_FILES.values() for f in pair if not (FASHION_DIR / f).is_file()]
    if missing:
        return [f"data.dataset: fashion_mnist reads Debian's files in {FASHION_DIR}, which has no {missing[0]}; "
                f"install them with: {FASHION_INSTALL} (or set root: to a torchvision FashionMNIST folder)"]
    return []


def load_gcompris_photos(image_size: int, **_: Any) -> ImageData:
    """266 distinct photographs from Debian's gcompris-qt-data (GCompris's activities: animals, monuments, fish,
    tools, objects, power plants, musicians; 7 classes), centre-cropped; decoded once, then cached in data_home()."""
    images, labels, _paths = gcompris.load_arrays(image_size)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    return split("gcompris_photos", x, torch.from_numpy(labels), len(gcompris.CLASSES))


def _check_gcompris(_: dict[str, Any]) -> list[str]:
    problem = gcompris.missing()
    return [f"data.dataset: {problem}"] if problem else []


def _kept(section: dict[str, Any], channels: int = 1) -> int:
    params = section.get("params", {})
    return channels * (params.get("max_train", LIMITS["max_train"].default)
                       + params.get("max_test", LIMITS["max_test"].default))


CHANNELS = {"cifar10": 3, "cifar100": 3, "mnist": 1, "fashion_mnist": 1, "imagefolder": 3}

LIMITS = {"max_train": Param(10000, int, min=1, help="training images kept"),
          "max_test": Param(2000, int, min=1, help="test images kept")}

BUILTIN = [
    DatasetSpec("digits", load_digits, summary=load_digits.__doc__ or "", values=lambda s: 1797),
    DatasetSpec("lfw", load_lfw, summary=load_lfw.__doc__ or "", values=lambda s: 200),
    DatasetSpec("photos", load_photos, {"crops": Param(64, int, min=1, help="crops per photograph")},
                summary=load_photos.__doc__ or "",
                values=lambda s: 3 * len(PHOTOS) * s.get("params", {}).get("crops", 64)),
    *(DatasetSpec(n, _foolbox_loader(n), summary=_foolbox_loader(n).__doc__ or "", check=_check_foolbox,
                  values=lambda s: 3 * 20) for n in FOOLBOX_SETS),
    *(DatasetSpec(n, _torchvision_loader(n), dict(LIMITS), summary=_torchvision_loader(n).__doc__ or "",
                  check=_check_root(n), values=partial(_kept, channels=CHANNELS[n]))
      for n in (*TORCHVISION_SETS, "imagefolder") if n != "fashion_mnist"),
    DatasetSpec("gcompris_photos", load_gcompris_photos, summary=load_gcompris_photos.__doc__ or "",
                check=_check_gcompris, values=lambda s: 3 * gcompris.CREDITED),
    DatasetSpec("fashion_mnist", load_fashion_mnist, dict(LIMITS), summary=load_fashion_mnist.__doc__ or "",
                check=_check_fashion, values=lambda s: _kept(s)),
]


@hookimpl
def register_datasets():
    return BUILTIN
