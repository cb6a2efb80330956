"""Gradients summed over a group in one flat buffer whichever of them this rank holds, as DDP.

Ranks of a data-parallel job may disagree on which parameters have a gradient (a data-dependent
branch takes a head on some ranks only), so the buffer is laid out from the parameters, not
from the gradients: `sum_gradients` gives every member a slot (its gradient / divisor, zeros
where this rank has none or a sparse one) and appends three counts per member (the ranks that
had a gradient, those whose gradient was sparse COO, the sum of those sparse dims). One SUM
AllReduce of the same size on every rank then tells every rank, alike, which members some rank
used and which are sparse (`Summed`); `sum_sparse` sums a sparse member on its own
(`_sparse.all_reduce_sparse`). Each share is divided before the sum (as DDP): a sum of float16
gradients, or of a GradScaler's scaled ones, does not overflow where one rank's is finite. A
complex bucket travels as its real view, so the counts stay real numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.communication._collectives import ReduceOp, all_reduce_
from shardwise.communication._init import Group
from shardwise.communication._sparse import all_reduce_sparse

COUNTS = 3  # per member: ranks with a gradient, ranks with a sparse one, their sparse dims


@dataclass(frozen=True)
class Summed:
    """One member's share of the reduced buffer.

    Attributes:
        used: some rank had a gradient (False: keep ``.grad`` None on every rank).
        sparse_dim: 0, or the sparse dims of the ranks' sparse COO gradients: sum it with
            `sum_sparse` (its slot holds only the dense ones, if any).
        dense: the sum over the ranks of the dense gradients / divisor (a view of the buffer,
            of the member's shape and dtype).
    """

    used: bool
    sparse_dim: int
    dense: torch.Tensor


def buffer_numel(members: Sequence[torch.Tensor]) -> int:
    """The size (in the members' real dtype) of `sum_gradients`' flat buffer for `members`."""
    return sum(_real_numel(m) for m in members) + COUNTS * len(members)


def sum_gradients(
    members: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    divisor: float,
    group: str | Group | None,
    flat: torch.Tensor | None = None,
) -> list[Summed]:
    """Sum `grads` over `group` in one flat AllReduce laid out from `members` (one dtype, one
    device), whichever of them this rank holds.

    Args:
        members: the parameters (same dtype and device), the same list on every rank.
        grads: this rank's gradient of each member, or None.
        divisor: each share is divided by it before the sum (1: the sum).
        group: the group (None: the world).
        flat: a buffer of `buffer_numel(members)` elements in the members' real dtype to reuse
            (None: a new one).

    Returns:
        One `Summed` per member, in order; their ``dense`` views live in `flat`.

    Example:
        >>> out = sum_gradients(params, [p.grad for p in params], world, None)
    """
    assert len(grads) == len(members), (len(grads), len(members))
    like = members[0]
    real = like.dtype.to_real()
    if flat is None:
        flat = torch.empty(buffer_numel(members), dtype=real, device=like.device)
    sizes = [_real_numel(m) for m in members]
    dense_numel = sum(sizes)
    counts = [[0.0] * len(members) for _ in range(COUNTS)]
    parts = []
    for j, g in enumerate(grads):
        if g is None or g.layout != torch.strided:
            parts.append(flat.new_zeros(1).expand(sizes[j]))
        else:
            parts.append(_real_flat(g.detach()))
        if g is not None:
            counts[0][j] = 1.0
        if g is not None and g.layout != torch.strided:
            counts[1][j], counts[2][j] = 1.0, float(g.sparse_dim())
    torch.cat(parts, out=flat[:dense_numel])
    if divisor != 1:
        flat[:dense_numel].div_(divisor)
    flat[dense_numel:].copy_(torch.tensor(counts, dtype=real).view(-1))
    all_reduce_(flat, ReduceOp.SUM, group)
    used, sparse, dims = flat[dense_numel:].view(COUNTS, -1).tolist()
    out, offset = [], 0
    for j, m in enumerate(members):
        slot = flat[offset : offset + sizes[j]]
        offset += sizes[j]
        sparse_dim = round(dims[j] / sparse[j]) if sparse[j] >= 0.5 else 0
        out.append(Summed(used[j] >= 0.5, sparse_dim, _from_real_flat(slot, m)))
    return out


def sum_sparse(
    member: torch.Tensor,
    grad: torch.Tensor | None,
    divisor: float,
    group: str | Group | None,
    sparse_dim: int,
) -> torch.Tensor | None:
    """`grad` (sparse COO; an empty one where this rank has none, a dense one made sparse)
    summed over `group`, each share / `divisor` first (`_sparse.all_reduce_sparse`: the union
    of the ranks' rows); None on every rank when no rank holds a row. Every rank of the group
    calls it for the member (`Summed.sparse_dim` says when)."""
    if grad is None:
        index = torch.zeros(sparse_dim, 0, dtype=torch.long, device=member.device)
        shape = (0, *member.shape[sparse_dim:])
        grad = torch.sparse_coo_tensor(
            index, torch.zeros(shape, dtype=member.dtype, device=member.device), member.shape
        )
    elif grad.layout == torch.strided:
        grad = grad.to_sparse(sparse_dim)
    out = all_reduce_sparse(grad, group, divisor)
    return out if out.indices().shape[1] else None


def _real_numel(t: torch.Tensor) -> int:
    return t.numel() * (2 if t.is_complex() else 1)


def _real_flat(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened; a complex one as its real and imaginary parts interleaved (real dtype)."""
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj()).reshape(-1)
    return t.reshape(-1)


def _from_real_flat(slot: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`_real_flat`'s inverse: `slot` viewed as a tensor of `like`'s shape and dtype."""
    if like.is_complex():
        return torch.view_as_complex(slot.view(*like.shape, 2))
    return slot.view(like.shape)
