"""Checks for test_layout_placements_real.py: on real gloo processes, `distribute_tensor` with
`to_placements(layout)` leaves every rank exactly ``global[layout.local_slice(rank, shape)]``, and
``full_tensor()`` (DTensor's own shard -> replicate path) restores the global tensor.

Checks every 2-D layout (each axis splits dim 0, dim 1 or nothing, in every tuple order) on the
meshes (2, 2, 2) = (dp, sp, mp), (2, 4) and (4, 2), plus seed 003's two layouts by name. Prints
``CHECK <mesh> OK <count>``; any mismatch raises (the launcher reports the rank). `placements`
runs in the tests' one 8-process job (tests/parallel/train_step_worker.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import torch
from torch.distributed.tensor import distribute_tensor

import shardwise as sw
from shardwise.layout import DeviceMatrix, Layout, TensorLayout, device_mesh_for, to_placements


def all_layouts(matrix: DeviceMatrix) -> Iterator[TensorLayout]:
    axes = range(len(matrix.shape))
    for owner in itertools.product([None, 0, 1], repeat=len(matrix.shape)):
        groups = [[a for a in axes if owner[a] == d] for d in range(2)]
        for dims in itertools.product(*(itertools.permutations(g) for g in groups)):
            yield TensorLayout(matrix, tuple(dims))


def check(layout: TensorLayout, mesh: torch.distributed.device_mesh.DeviceMesh) -> None:
    rank = sw.communication.get_rank()
    n = layout.matrix.size
    full = torch.arange(n * n * 6, dtype=torch.float32).reshape(2 * n, 3 * n)
    placements = to_placements(layout)
    dt = distribute_tensor(full, mesh, placements)
    want = full[layout.local_slice(rank, full.shape)]
    if not torch.equal(dt.to_local(), want):
        raise AssertionError(
            f"rank {rank}: {layout} as {placements}: got rows/cols\n{dt.to_local()}\nwant\n{want}"
        )
    if not torch.equal(dt.full_tensor(), full):
        raise AssertionError(f"rank {rank}: {layout} as {placements}: full_tensor() differs")


def placements() -> None:
    """Every check, in a job that has called ``init()``."""
    # DTensor warns that multi-dim all_gathers are sequential; expected here
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    mesh = device_mesh_for(layout.matrix)
    check(layout("mp", ("sp", "dp")), mesh)
    check(layout(("sp", "dp"), "None"), mesh)
    print("CHECK seed003 OK", flush=True)
    for shape in [(2, 2, 2), (2, 4), (4, 2)]:
        matrix = DeviceMatrix(shape, tuple(f"a{i}" for i in range(len(shape))))
        mesh = device_mesh_for(matrix)
        count = 0
        for t in all_layouts(matrix):
            check(t, mesh)
            count += 1
        print(f"CHECK {shape} OK {count}", flush=True)
    torch.distributed.barrier()
