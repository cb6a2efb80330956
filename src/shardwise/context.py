"""Global settings shared by every rank: `set_seed` for now.

`set_seed(seed)` seeds Python's `random`, NumPy (when installed) and torch (CPU and every CUDA
device) identically on every rank, and makes CPU runs bit-for-bit repeatable.
"""

from __future__ import annotations

import random

import torch

_seed: int | None = None


def set_seed(seed: int) -> None:
    """Seed every random number generator shardwise and the user's script draw from.

    Every rank gets the same seed (as in MindSpore's ``set_seed``): identical initial weights
    and identical data order on every rank; per-rank randomness (dropout masks of sharded
    tensors) is derived from it by the parallel layers, never by re-seeding.

    Args:
        seed: a non-negative integer.

    Raises:
        ValueError: `seed` is not a non-negative int.

    Example:
        >>> sw.set_seed(1)
        >>> a = torch.rand(2); sw.set_seed(1); torch.equal(a, torch.rand(2))
        True
    """
    global _seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"set_seed: seed={seed!r} must be a non-negative int")
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    _seed = seed


def get_seed() -> int | None:
    """The seed given to the last `set_seed`, or None."""
    return _seed
