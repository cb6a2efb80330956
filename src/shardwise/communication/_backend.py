"""Which torch.distributed backend `init()` uses: `default_backend` picks one, `check_backend`
refuses, with what to do instead, one that is unknown or that this torch/machine cannot run
(``init("nccl")`` of a MindSpore GPU script on a CPU-only torch failed inside torch with
``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl", "mpi")


def default_backend() -> str:
    """``"nccl"`` when CUDA is available and torch has NCCL, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def check_backend(backend: str | None) -> str:
    """The backend `init(backend)` uses: `backend`, or `default_backend()` for None.

    Raises:
        ValueError: `backend` is not one of `BACKENDS`, or this torch/machine cannot run it
            (``"nccl"`` without CUDA or on a torch built without NCCL, ``"mpi"`` on a torch
            built without MPI).

    Example:
        >>> check_backend("gloo")
        'gloo'
    """
    if backend is None:
        return default_backend()
    if backend not in BACKENDS:
        raise ValueError(
            f"init(backend={backend!r}): expected 'gloo', 'nccl', 'mpi' or None (picks "
            f"{default_backend()!r} here)"
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "init(backend='nccl'): backend 'nccl' needs CUDA, which this torch/machine lacks; "
            "use 'gloo', or init() to pick one"
        )
    if backend == "nccl" and not dist.is_nccl_available():
        raise ValueError(
            "init(backend='nccl'): CUDA is available but this torch was built without NCCL; "
            "use 'gloo', or init() to pick one"
        )
    if backend == "mpi" and not dist.is_mpi_available():
        raise ValueError(
            "init(backend='mpi'): this torch was built without MPI; use 'gloo', or init() to "
            "pick one"
        )
    return backend
