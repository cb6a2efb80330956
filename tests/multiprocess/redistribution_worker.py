"""Checks for test_redistribution_real.py: `redistribute` on real gloo processes.

For each case every rank checks that its block equals the single-device tensor's block under
the destination layout, and that the gradients (exact adjoints: partial on replicas) summed over
all ranks equal single-device autograd. Cases use tuple-axis layouts and device matrices whose
`rank_list` orders groups differently from sorted order (blocks permuted around collectives).
Each rank prints ``CHECK <name> OK``; a mismatch raises. `redistributions` runs in the tests'
one 8-process job (tests/parallel/train_step_worker.py).
"""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.communication import get_group_size, get_rank
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.redistribution import plan_redistribution, redistribute

SHAPE = (8, 8, 4)
Alias = str | tuple[str, ...] | None


def lay(matrix: DeviceMatrix, *aliases: Alias) -> TensorLayout:
    def axes(alias: Alias) -> tuple[int, ...]:
        if alias is None:
            return ()
        return tuple(matrix.axis(n) for n in ((alias,) if isinstance(alias, str) else alias))

    return TensorLayout(matrix, tuple(axes(a) for a in aliases))


def cases(n: int) -> list[tuple[str, TensorLayout, TensorLayout]]:
    plain = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"))
    backwards = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"), tuple(range(n - 1, -1, -1)))
    shuffled = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"), (3, 0, 6, 5, 1, 7, 2, 4))
    out = []
    for tag, m in (("plain", plain), ("reversed", backwards), ("shuffled", shuffled)):
        out += [
            (f"{tag}:dp,sp,mp->mp,(sp,dp),None", lay(m, "dp", "sp", "mp"),
             lay(m, "mp", ("sp", "dp"), None)),
            (f"{tag}:mp,(sp,dp),None->None,None,None", lay(m, "mp", ("sp", "dp"), None),
             lay(m, None, None, None)),
            (f"{tag}:(dp,sp,mp),None,None->(mp,sp,dp),None,None",
             lay(m, ("dp", "sp", "mp"), None, None), lay(m, ("mp", "sp", "dp"), None, None)),
            (f"{tag}:dp,mp,None->mp,dp,None", lay(m, "dp", "mp", None), lay(m, "mp", "dp", None)),
        ]  # fmt: skip
    return out


def check(name: str, src: TensorLayout, dst: TensorLayout) -> None:
    rank, n = get_rank(), get_group_size()
    g = torch.Generator().manual_seed(len(name))
    full = torch.randn(SHAPE, generator=g)
    upstream = [torch.randn(dst.local_shape(SHAPE), generator=g) for _ in range(n)]
    leaf = full.clone().requires_grad_()
    sum((leaf[dst.local_slice(r, SHAPE)] * w).sum() for r, w in enumerate(upstream)).backward()
    x = full[src.local_slice(rank, SHAPE)].clone().requires_grad_()
    with sw.communication.CommRecorder() as rec:
        y = redistribute(x, src, dst, SHAPE)
        (y * upstream[rank]).sum().backward()
    if not torch.equal(y, full[dst.local_slice(rank, SHAPE)]):
        raise AssertionError(f"{name}: rank {rank} holds the wrong block")
    plan = plan_redistribution(src, dst, SHAPE)
    got = [(r.kind, r.group) for r in rec.select(phase="forward")]
    if got != plan.collectives(rank):
        raise AssertionError(f"{name}: collectives {got} != plan {plan.collectives(rank)}")
    assert x.grad is not None
    mine = torch.zeros(SHAPE)
    mine[src.local_slice(rank, SHAPE)] = x.grad
    total = sw.ops.AllReduce()(mine)
    assert leaf.grad is not None
    if not torch.allclose(total, leaf.grad, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"{name}: gradients summed over ranks differ from single device")
    print(f"CHECK {name} OK", flush=True)


def redistributions() -> None:
    """Every case, in a job that has called ``init()``."""
    for name, src, dst in cases(get_group_size()):
        check(name, src, dst)
