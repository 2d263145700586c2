"""Every random draw of an audit derives from its ``seed:``: stable seeds and generators named by what they draw."""
from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that depends only on ``parts`` (stable across processes and runs)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(device: torch.device | str, *parts: object) -> torch.Generator:
    """A generator on ``device`` seeded from ``parts``."""
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))
