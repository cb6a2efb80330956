"""`all_reduce_sparse`: a sparse COO gradient (``nn.Embedding(sparse=True)``) summed over a group.

The ranks' gradients hold different rows (indices), so no flat buffer fits them all. Each rank
marks the rows it holds (an AllReduce(MAX) of a row mask) and scatters its values into a dense
tensor of the gradient's shape (an AllReduce(SUM)); the result is sparse again, with the union
of the ranks' rows (coalesced), so a sparse optimizer (``torch.optim.SparseAdam``) updates the
rows one device's gradient of the global batch holds. The dense sum costs the parameter's size
in bytes, as a dense gradient would.
"""

from __future__ import annotations

import torch

from shardwise.communication._collectives import ReduceOp, all_reduce_
from shardwise.communication._init import Group


def all_reduce_sparse(
    g: torch.Tensor, group: str | Group | None, divisor: float = 1.0
) -> torch.Tensor:
    """`g` (sparse COO) summed over `group`, each share divided by `divisor` first.

    Args:
        g: this rank's sparse COO gradient.
        group: the group (None: the world).
        divisor: each rank's share is divided by it before the sum (the world size: a mean).

    Returns:
        A new coalesced sparse COO tensor: the sum at the union of the ranks' indices.

    Raises:
        TypeError: `g` is not sparse COO (a CSR / CSC / BSR gradient).

    Example:
        >>> emb.weight.grad = all_reduce_sparse(emb.weight.grad, None, world_size)
    """
    if g.layout != torch.sparse_coo:
        raise TypeError(f"a gradient of layout {g.layout}: only sparse COO ones are reduced")
    g = g.detach().coalesce()
    dims = g.sparse_dim()
    rows = torch.zeros(g.shape[:dims], dtype=torch.uint8, device=g.device)
    rows[tuple(g.indices())] = 1
    dense = g.to_dense()
    if divisor != 1:
        dense.div_(divisor)
    all_reduce_(rows, ReduceOp.MAX, group)
    all_reduce_(dense, ReduceOp.SUM, group)
    indices = rows.nonzero().t()
    values = dense[tuple(indices)]  # (indices from ``nonzero``: valid, no check needed)
    return torch.sparse_coo_tensor(indices, values, g.shape, check_invariants=False).coalesce()
