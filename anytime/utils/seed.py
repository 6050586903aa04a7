"""Seeding that makes a run, and a resumed run, repeat exactly."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed mixed from ``parts`` (e.g. ``derive_seed("augment", seed, epoch)``), so that distinct uses
    of one seed draw independent streams; stable across processes and Python versions."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
