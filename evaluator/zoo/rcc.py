"""A reader of Qt's binary resource files (``.rcc``, as ``rcc -binary`` writes them), in pure Python.

The layout (Qt's ``rcc.cpp`` and ``qresource.cpp``): a header ``qres``, the format version and the big-endian
offsets of the tree, the data and the names (version 3 adds the overall flags); a tree of fixed-size nodes (name
offset, flags, then a directory's child count and first child, or a file's locale and data offset; from version 2
the last-modified time), each name a length, a hash and UTF-16 text, each file's data a length and its bytes,
``qCompress``'d (a big-endian size, then a zlib stream) where the node's flags say so. Qt 5.13 and later may
also write zstd-compressed entries (flag 4); none of Debian's gcompris-qt-data 3.1 bundles holds one (their 4,861
entries are stored or zlib), so such an entry is refused in one line rather than read through a zstd module.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

MAGIC = b"qres"
COMPRESSED, DIRECTORY, COMPRESSED_ZSTD = 0x01, 0x02, 0x04


class RccError(ValueError):
    """A file that is not a Qt resource file, or an entry this reader does not decode (zstd)."""


def read_rcc(path: Path | str) -> dict[str, bytes]:
    """Every file of one resource bundle, ``{"/dir/name.ext": bytes}``, decompressed, in path order."""
    raw = Path(path).read_bytes()
    if raw[:4] != MAGIC:
        raise RccError(f"{path} is not a Qt resource file (no 'qres' header)")
    version, tree, data, names = struct.unpack_from(">4I", raw, 4)
    if version not in (1, 2, 3):
        raise RccError(f"{path} is a Qt resource file of format version {version}; versions 1 to 3 are read")
    node_size = 14 if version == 1 else 22
    files: dict[str, bytes] = {}
    stack = [(0, "")]
    while stack:
        index, prefix = stack.pop()
        offset = tree + index * node_size
        name_offset, flags = struct.unpack_from(">IH", raw, offset)
        name = "" if index == 0 else _name(raw, names + name_offset)
        here = f"{prefix}/{name}" if index else ""
        if flags & DIRECTORY:
            count, first = struct.unpack_from(">II", raw, offset + 6)
            stack.extend((first + i, here) for i in range(count))
        else:
            (data_offset,) = struct.unpack_from(">I", raw, offset + 10)
            files[here] = _payload(raw, data + data_offset, flags, f"{path}:{here}")
    return dict(sorted(files.items()))


def _name(raw: bytes, offset: int) -> str:
    """A node's name: a 16-bit length, a 32-bit hash, then that many UTF-16BE code units."""
    (length,) = struct.unpack_from(">H", raw, offset)
    return raw[offset + 6:offset + 6 + 2 * length].decode("utf-16-be")


def _payload(raw: bytes, offset: int, flags: int, where: str) -> bytes:
    """A file's bytes: a 32-bit length, then the bytes as stored, decompressed where ``flags`` say."""
    (size,) = struct.unpack_from(">I", raw, offset)
    stored = raw[offset + 4:offset + 4 + size]
    if flags & COMPRESSED:
        (expected,) = struct.unpack_from(">I", stored, 0)
        out = zlib.decompress(stored[4:])
        if len(out) != expected:
            raise RccError(f"{where}: zlib data of {len(out)} bytes, not the {expected} its header says")
        return out
    if flags & COMPRESSED_ZSTD:
        raise RccError(f"{where} is zstd-compressed, which this reader does not decode (Debian's gcompris-qt-data "
                       "bundles hold only stored and zlib entries)")
    return stored
