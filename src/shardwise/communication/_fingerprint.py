"""A tensor's dtype and shape as `LENGTH` int64 entries (its fingerprint), and `check_alike`.

- `fingerprint` / `read`: the entries and back: the dtype (`DTYPES` index, -1 for another), the
  number of dims and the shape (up to ``LENGTH - 2`` dims). `_exchange` sends them before each
  point-to-point message, for its receiver to check.
- `check_alike`: under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` only, compares the fingerprints of a
  group's ranks (one small all-gather) before a collective torch's checking process groups do
  not compare: they check an all-to-all's kind, not its shapes, and gloo then aborts one rank and
  hands another wrong values. Every rank raises the same ValueError where they differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.communication import _sim, _trace
from shardwise.communication._init import Group

LENGTH = 16

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
)  # fmt: skip

WIDEST = max(torch.empty(0, dtype=d).element_size() for d in DTYPES)  # (bytes per element)


def code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """`t`'s dtype and shape as `LENGTH` int64 entries (on the CPU)."""
    head = torch.zeros(LENGTH, dtype=torch.int64)
    head[0], head[1] = code(t.dtype), t.dim()
    head[2 : 2 + min(t.dim(), LENGTH - 2)] = torch.tensor(t.shape[: LENGTH - 2])
    return head


def read(entries: list[int]) -> tuple[list[int], torch.dtype | None]:
    """The shape and dtype (None: not one of `DTYPES`) of a `fingerprint`'s entries."""
    dtype_code, ndim = int(entries[0]), int(entries[1])
    shape = [int(d) for d in entries[2 : 2 + min(ndim, LENGTH - 2)]]
    return shape, DTYPES[dtype_code] if 0 <= dtype_code < len(DTYPES) else None


def _detail() -> bool:
    """Whether torch's debug level (``TORCH_DISTRIBUTED_DEBUG``) is DETAIL (torch's public
    ``torch.distributed.get_debug_level``, which its stubs do not re-export)."""
    level = dist.get_debug_level()  # type: ignore[attr-defined]
    return bool(level == dist.DebugLevel.DETAIL)  # type: ignore[attr-defined]


def check_alike(what: str, t: torch.Tensor, g: Group) -> None:
    """Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, in a job: every rank of `g` passes the same
    shape and dtype to the collective `what`, or every rank raises a ValueError naming each."""
    if _sim.current() is not None or not _detail():
        return
    mine = fingerprint(t).to(t.device)
    rows = mine.new_empty(len(g.ranks) * LENGTH)
    token = _trace.enter(what, g)
    dist.all_gather_into_tensor(rows, mine, group=g.pg)
    _trace.leave(token)
    seen = rows.view(len(g.ranks), LENGTH).tolist()
    if any(row != seen[0] for row in seen):
        detail = ", ".join(
            f"rank {rank}: shape {shape} of {dtype or 'another dtype'}"
            for rank, (shape, dtype) in zip(g.ranks, map(read, seen), strict=True)
        )
        raise ValueError(
            f"{what}: Detected mismatch between collectives on ranks of group {g}: {detail}; "
            "every rank of the group must pass the same shape and dtype"
        )
