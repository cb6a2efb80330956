"""Manual data parallel: average (or sum) gradients over the ranks, in fused buckets.

`DistributedGradReducer` groups parameters into buckets of at most `bucket_mb` MiB (same dtype and
device, in parameter order), and per bucket: flattens the gradients (`_flatten`), issues one
AllReduce, scales by 1/degree when `mean`, and copies the result back (`_unflatten`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from shardwise.communication import _collectives as C
from shardwise.communication._init import Group, get_group_size

DEFAULT_BUCKET_MB = 25.0


def _buckets(tensors: Sequence[torch.Tensor], limit_bytes: int) -> list[list[int]]:
    """Indices of `tensors` grouped into consecutive same-dtype/device buckets under the limit."""
    out: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        prev = tensors[out[-1][-1]] if out else None
        same_kind = prev is not None and (prev.dtype, prev.device) == (t.dtype, t.device)
        if not out or not same_kind or size + nbytes > limit_bytes:
            out.append([i])
            size = nbytes
        else:
            out[-1].append(i)
            size += nbytes
    return out


class DistributedGradReducer:
    """All-reduce gradients across the data-parallel ranks (MindSpore's DistributedGradReducer).

    Args:
        parameters: the parameters whose gradients to reduce (e.g. ``net.parameters()``).
        mean: divide the sum by `degree` (the average gradient); False keeps the sum.
        degree: the divisor for `mean` (default: the group size).
        group: group name, or None for the world group.
        bucket_mb: largest fused bucket, in MiB.

    Example:
        >>> reducer = sw.nn.DistributedGradReducer(net.parameters())
        >>> loss.backward(); reducer(); optimizer.step()
        >>> grads = reducer(grads)          # MindSpore form: reduced copies of a tuple of grads
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        mean: bool = True,
        degree: int | None = None,
        group: str | Group | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        if degree is not None and (
            isinstance(degree, bool) or not isinstance(degree, int) or degree < 1
        ):
            raise ValueError(f"DistributedGradReducer: degree={degree!r} must be an int >= 1")
        if bucket_mb <= 0:
            raise ValueError(f"DistributedGradReducer: bucket_mb={bucket_mb} must be > 0")
        self.mean, self.degree, self.group = mean, degree, group
        self.bucket_bytes = int(bucket_mb * 2**20)

    def __call__(
        self, grads: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...] | None:
        """Reduce ``p.grad`` of every parameter in place (no argument), or return reduced
        copies of `grads`.

        Parameters whose ``.grad`` is None are skipped (every rank of a data-parallel job runs
        the same network, so they agree on which ones).
        """
        if grads is not None:
            reduced = self._reduce([g.detach() for g in grads])
            return tuple(reduced)
        params = [p for p in self.parameters if p.grad is not None]
        reduced = self._reduce([p.grad for p in params if p.grad is not None])
        for p, g in zip(params, reduced, strict=True):
            assert p.grad is not None
            p.grad.copy_(g)
        return None

    def _reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        degree = self.degree or get_group_size(self.group)
        out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
        for bucket in _buckets(tensors, self.bucket_bytes):
            flat = torch.cat([tensors[i].reshape(-1) for i in bucket])
            flat = C.all_reduce(flat, C.ReduceOp.SUM, self.group)
            if self.mean:
                flat = flat / degree
            offset = 0
            for i in bucket:
                n = tensors[i].numel()
                out[i] = flat[offset : offset + n].view_as(tensors[i])
                offset += n
        return out
