"""Device meshes for DTensor: the process groups of every mesh dim, created here because only
`communication/` creates process groups. `device_mesh` gives every mesh-dim group shardwise's
timeout (`comm_timeout`), never torch's 30 minutes.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardwise._torch.c10d import BackendOptions, gloo_options, nccl_options
from shardwise.communication._store_sync import comm_timeout


def _backend_override(
    device_type: str, ndim: int, timeout: datetime.timedelta
) -> tuple[tuple[str | None, BackendOptions | None], ...] | None:
    """Per mesh dim, the backend and options carrying `timeout` (None: torch's defaults)."""
    if device_type == "cpu" and dist.is_gloo_available():
        backend, opts = "gloo", gloo_options(timeout)
    elif device_type == "cuda" and dist.is_nccl_available():
        backend, opts = "nccl", nccl_options(timeout)
    else:
        return None
    return tuple((backend, opts) for _ in range(ndim))


def device_mesh(
    rank_list: Sequence[int],
    shape: Sequence[int],
    names: Sequence[str],
    device_type: str = "cpu",
    timeout: datetime.timedelta | None = None,
) -> DeviceMesh:
    """A `DeviceMesh` of `shape` over `rank_list` (row-major) with dims named `names`.

    Args:
        rank_list: global ranks, row-major.
        shape: mesh shape.
        names: one name per mesh dim.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
        timeout: for the mesh-dim groups; default `comm_timeout()`.

    Returns:
        The mesh.

    Example:
        >>> mesh = device_mesh(range(8), (2, 2, 2), ("dp", "sp", "mp"))
    """
    timeout = timeout or comm_timeout()
    ranks = torch.tensor(list(rank_list), dtype=torch.int).reshape(tuple(shape))
    override = _backend_override(device_type, len(shape), timeout)
    if override is None:
        return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(names))
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(names), backend_override=override)
