"""Natural photographs offline: the photos of Debian's gcompris-qt-data (GCompris's activities), read from its Qt
resource bundles, labelled by what they show, de-duplicated, centre-cropped and cached in data_home().

Which bundles hold photographs, not drawings, was read off contact sheets of every bundle: categorization's
category folders, erase's and the explore activities' animals and monuments, details' full monument photos (its
other images are pieces of them or van Gogh paintings) and explore_world_music's musicians.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
from pathlib import Path

import numpy as np

from leakaudit.evaluator.zoo.rcc import read_rcc
from leakaudit.evaluator.zoo.shipped import data_home

#: Where Debian's gcompris-qt-data puts GCompris's resource bundles.
RCC_DIR = Path("/usr/share/gcompris-qt/rcc")
INSTALL = "apt-get install -y gcompris-qt-data"
ACTIVITIES = "/gcompris/src/activities/"
#: (bundle, folder inside it, class): the photographs, in this order; a class's name says what its photos show.
SOURCES = (
    ("categorization", "categorization/resource/images/fishes/", "fish"),
    ("categorization", "categorization/resource/images/monuments/", "monument"),
    ("explore_monuments", "explore_monuments/resource/", "monument"),
    ("details", "details/resource/image/", "monument"),
    ("categorization", "categorization/resource/images/renewable/", "power_plant"),
    ("categorization", "categorization/resource/images/tools/", "tool"),
    ("categorization", "categorization/resource/images/others/", "object"),
    ("categorization", "categorization/resource/images/alphabets/", "object"),
    ("categorization", "categorization/resource/images/numbers/", "object"),
    ("erase", "erase/resource/", "animal"),
    ("explore_world_animals", "explore_world_animals/resource/animals/", "animal"),
    ("explore_farm_animals", "explore_farm_animals/resource/animals/", "animal"),
    ("explore_world_music", "explore_world_music/resource/music/", "music"),
)
CLASSES = tuple(dict.fromkeys(c for _, _, c in SOURCES))
#: details' whole photographs (its other files are pieces cut from them, or van Gogh's paintings).
DETAILS_PHOTOS = ("Chenonceau", "EgeskovSlotSpejling", "EilanDonanCastle", "FanoeWindmill", "GizahPyramids",
                  "Louvre_2007_02_24_c", "NDP", "Nagoya", "Neuschwanstein", "OperaSidney", "TajMahal", "TourEiffel",
                  "TowerBridgeLondon")
#: Photos whose 16x16 average hashes differ in at most this many of 256 bits are one photo (the same picture
#: in two activities, cropped or encoded differently).
NEAR = 12
#: The side the hashes are taken at, whatever image_size is asked for (so the same photos are kept at every size).
HASH_SIDE = 64
#: Photos credited in Debian's 3.1 bundles before de-duplication: a bound on those kept, for the memory estimate.
CREDITED = 269
#: Bump when the selection or the decoding changes: the cache's name carries it.
CACHE_VERSION = 1


def missing() -> str | None:
    """One line saying what to install where a bundle is absent, else None."""
    absent = sorted({b for b, _, _ in SOURCES if not (RCC_DIR / f"{b}.rcc").is_file()})
    if absent:
        return (f"dataset gcompris_photos reads GCompris's photos in {RCC_DIR}, which has no {absent[0]}.rcc; "
                f"install them with: {INSTALL}")
    return None


def photo_files() -> list[tuple[str, bytes, int, str]]:
    """The chosen photos' (path, encoded bytes, class index, licence) before de-duplication, in SOURCES order then
    by path; a photo the README beside it does not credit is left out (one, explore_monuments' aulaPalatina)."""
    bundles: dict[str, dict[str, bytes]] = {}
    out = []
    for bundle, folder, cls in SOURCES:
        files = bundles.setdefault(bundle, read_rcc(RCC_DIR / f"{bundle}.rcc"))
        prefix = ACTIVITIES + folder
        credits = readme_licences(files[prefix + "README"].decode("utf-8")) if prefix + "README" in files else {}
        for path, data in files.items():
            name = path.removeprefix(prefix)
            if not path.startswith(prefix) or not name.endswith(".webp") or name not in credits:
                continue
            if bundle == "details" and name.removesuffix("_background.webp") not in DETAILS_PHOTOS:
                continue
            out.append((path, data, CLASSES.index(cls), credits[name]))
    return out


def centre_squares(data: bytes, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """One encoded photo, decoded once, as (size, size, 3) uint8 arrays: its centre square resized with Lanczos
    (reducing_gap 3: first shrunk by a whole factor while more than 3 times too large, Pillow's near-exact shortcut
    that makes the resize eight times faster)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    w, h = rgb.size
    side = min(w, h)
    box = ((w - side) // 2, (h - side) // 2, (w - side) // 2 + side, (h - side) // 2 + side)
    lanczos = Image.Resampling.LANCZOS
    return [np.asarray(rgb.resize((size, size), lanczos, box=box, reducing_gap=3.0)) for size in sizes]


def average_hash(image: np.ndarray) -> np.ndarray:
    """256 bits: which cells of a 16x16 grey thumbnail are brighter than its mean."""
    from PIL import Image

    thumbnail = Image.fromarray(image).convert("L").resize((16, 16), Image.Resampling.BILINEAR)
    grey = np.asarray(thumbnail, dtype=np.float32)
    return (grey > grey.mean()).ravel()


def distinct(images: np.ndarray) -> np.ndarray:
    """Indices of the images kept: each one unless an earlier kept image is within NEAR bits of its hash."""
    hashes = np.stack([average_hash(im) for im in images])
    kept: list[int] = []
    for i, h in enumerate(hashes):
        if all(np.count_nonzero(h != hashes[j]) > NEAR for j in kept):
            kept.append(i)
    return np.array(kept, dtype=np.int64)


def load_arrays(image_size: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(N, size, size, 3) uint8 photos, their class indices and paths: decoded once (seconds), then cached."""
    cache = data_home() / "gcompris_photos" / f"v{CACHE_VERSION}-{_bundles_key()}-{image_size}px.npz"
    if cache.is_file():
        with np.load(cache) as saved:
            return saved["images"], saved["labels"], [str(p) for p in saved["paths"]]
    files = photo_files()
    thumbs, squares = zip(*(centre_squares(data, (HASH_SIDE, image_size)) for _, data, _, _ in files))
    keep = distinct(np.stack(thumbs))
    images = np.stack([squares[i] for i in keep])
    labels = np.array([files[i][2] for i in keep], dtype=np.int64)
    paths = [files[i][0] for i in keep]
    partial = cache.with_name(f"{cache.stem}.{os.getpid()}.partial.npz")  # two workers never write one file
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.savez(partial, images=images, labels=labels, paths=np.array(paths))
        partial.replace(cache)
    except OSError:  # a read-only cache folder: the photos are decoded again next time, nothing else changes
        with contextlib.suppress(OSError):
            partial.unlink()
    return images, labels, paths


def _bundles_key() -> str:
    """A short digest of the bundles' names, sizes and times: a new package version decodes afresh."""
    parts = [f"{b}:{(RCC_DIR / f'{b}.rcc').stat().st_size}:{(RCC_DIR / f'{b}.rcc').stat().st_mtime_ns}"
             for b in sorted({b for b, _, _ in SOURCES})]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def licences() -> dict[str, str]:
    """Each chosen photo's licence, as the README beside it in its bundle states it ({path: licence})."""
    return {path: licence for path, _, _, licence in photo_files()}


#: A file name misspelt in categorization's tools/README (its stanza credits Oktaeder's Schraubenzieher.jpg).
README_TYPOS = {"screDriver.webp": "screwDriver.webp"}


def readme_licences(text: str) -> dict[str, str]:
    """GCompris's README credits: stanzas of Copyright, Source, License and file names ({file name: licence},
    the licence's spelling made uniform: "CC-BY-SA 4.0" as "CC-BY-SA-4.0", "Public domain" as "Public Domain")."""
    out = {}
    for stanza in re.split(r"\n\s*\n", text):
        licence = re.search(r"^License:\s*(.+?)\s*$", stanza, re.M)
        if not licence:
            continue
        name = re.sub(r"\s+(?=\d)", "-", licence.group(1))
        name = "Public Domain" if name.lower() == "public domain" else name
        for line in stanza.splitlines():
            file = line.removeprefix("Files:").strip()
            if file.endswith(".webp") and not file.startswith(("Source", "Comment")):
                out[README_TYPOS.get(file, file)] = name
    return out
