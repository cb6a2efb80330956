"""Manual data parallel: average (or sum) gradients over the ranks, in fused buckets.

`DistributedGradReducer` groups the parameters that require grad at the call (each once,
however often listed) into buckets of at most `bucket_mb` MiB (same dtype and device, in
parameter order), and per bucket: copies the gradients into one flat buffer (kept across
steps, so no allocation per step), scales it by 1/degree when `mean` (before the sum, as DDP:
a sum of float16 gradients does not overflow where one rank's is finite), all-reduces it in
place, and copies the result back (`_reduce_into_buffers`). A sparse COO gradient
(``nn.Embedding(sparse=True)``) is reduced on its own and made sparse again
(`communication._sparse.all_reduce_sparse`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from shardwise.communication import _collectives as C
from shardwise.communication._init import Group, get_group_size
from shardwise.communication._sparse import all_reduce_sparse

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


def _checked_parameters(parameters: object) -> list[torch.Tensor]:
    """`parameters` as a list of tensors.

    Raises:
        TypeError: a module (naming ``net.parameters()``), a single tensor, something not
            iterable, or an item that is no tensor (naming its index and type).
    """
    if isinstance(parameters, torch.nn.Module):
        kind = type(parameters).__name__
        raise TypeError(
            f"DistributedGradReducer: parameters is a module ({kind}), not its parameters; pass "
            f"DistributedGradReducer(net.parameters())"
        )
    if isinstance(parameters, torch.Tensor) or not isinstance(parameters, Iterable):
        raise TypeError(
            f"DistributedGradReducer: parameters must be an iterable of parameters (e.g. "
            f"net.parameters(), or [p] for one), got {type(parameters).__name__}"
        )
    out = list(parameters)
    for i, p in enumerate(out):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"DistributedGradReducer: parameters[{i}] is a {type(p).__name__}, not a "
                f"parameter; pass tensors, e.g. net.parameters()"
            )
    return out


class DistributedGradReducer:
    """All-reduce gradients across the data-parallel ranks (MindSpore's DistributedGradReducer).

    Args:
        parameters: the parameters whose gradients to reduce (e.g. ``net.parameters()``); one
            listed twice (tied) is reduced once; those that require grad at a call take part
            (a layer unfrozen after the reducer is built is reduced from then on).
        mean: divide each rank's gradient by `degree` before the sum (the average gradient);
            False keeps the sum.
        degree: the divisor for `mean` (default: the group size).
        group: group name, or None for the world group.
        bucket_mb: largest fused bucket, in MiB.

    Raises:
        TypeError: `parameters` a module (pass ``net.parameters()``), not iterable, or holding
            something else than tensors; `mean` not a bool; `bucket_mb` not a number.
        ValueError: `bucket_mb` not above 0; `degree` not an int >= 1.

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
        unique = {id(p): p for p in _checked_parameters(parameters)}  # (tied ones listed twice)
        self.parameters = list(unique.values())
        if degree is not None and (
            isinstance(degree, bool) or not isinstance(degree, int) or degree < 1
        ):
            raise ValueError(f"DistributedGradReducer: degree={degree!r} must be an int >= 1")
        if not isinstance(mean, bool):
            raise TypeError(
                f"DistributedGradReducer: mean={mean!r} must be True (average the gradients) or "
                f"False (keep their sum)"
            )
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, int | float):
            raise TypeError(
                f"DistributedGradReducer: bucket_mb={bucket_mb!r} must be a number of MiB > 0 "
                f"(e.g. {DEFAULT_BUCKET_MB})"
            )
        if not bucket_mb > 0:
            raise ValueError(
                f"DistributedGradReducer: bucket_mb={bucket_mb} must be > 0 (MiB per fused "
                f"bucket, e.g. {DEFAULT_BUCKET_MB})"
            )
        self.mean, self.degree, self.group = mean, degree, group
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._bucket_buffers: dict[tuple[object, ...], torch.Tensor] = {}

    def __call__(
        self, grads: Sequence[torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor | None, ...] | None:
        """Reduce ``p.grad`` of every parameter in place (no argument), or return reduced
        copies of `grads`.

        Parameters whose ``.grad`` is None are skipped (every rank of a data-parallel job runs
        the same network, so they agree on which ones); so are None entries of `grads`
        (``torch.autograd.grad(..., allow_unused=True)``), returned as None.
        """
        if grads is not None:
            copies = [None if g is None else g.detach().clone() for g in grads]
            dense = [c for c in copies if c is not None and c.layout == torch.strided]
            self._reduce_into_buffers(dense, {})
            return tuple(
                self._sparse(c, i) if c is not None and c.layout != torch.strided else c
                for i, c in enumerate(copies)
            )
        params = [p for p in self.parameters if p.requires_grad]  # (at this call: unfrozen ones)
        grads = [p.grad for p in params]
        live = [g for g in grads if g is not None and g.layout == torch.strided]
        self._reduce_into_buffers(live, self._bucket_buffers)
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if g is not None and g.layout != torch.strided:
                p.grad = self._sparse(g, i)
        return None

    def _sparse(self, g: torch.Tensor, i: int) -> torch.Tensor:
        """A sparse gradient (``nn.Embedding(sparse=True)``) reduced, sparse again
        (`communication._sparse.all_reduce_sparse`: for ``torch.optim.SparseAdam``)."""
        if g.layout != torch.sparse_coo:
            raise TypeError(
                f"DistributedGradReducer: gradient {i} has layout {g.layout}; only dense and "
                f"sparse COO gradients (nn.Embedding(sparse=True)) are reduced"
            )
        divisor = (self.degree or get_group_size(self.group)) if self.mean else 1
        return all_reduce_sparse(g, self.group, divisor)

    def _reduce_into_buffers(
        self, tensors: list[torch.Tensor], cache: dict[tuple[object, ...], torch.Tensor]
    ) -> None:
        """All-reduce `tensors` in place, one flat buffer per bucket (reused via `cache`)."""
        degree = self.degree or get_group_size(self.group)
        for bucket in _buckets(tensors, self.bucket_bytes):
            parts = [tensors[i] for i in bucket]
            key = tuple((t.shape, t.dtype, t.device) for t in parts)
            flat = cache.get(key)
            if flat is None:
                flat = parts[0].new_empty(sum(t.numel() for t in parts))
                cache[key] = flat
            torch.cat([t.reshape(-1) for t in parts], out=flat)
            if self.mean:  # (before the sum: a float16 sum overflows where the mean does not)
                flat.div_(degree)
            C.all_reduce_(flat, C.ReduceOp.SUM, self.group)
            offset = 0
            for t in parts:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
