"""Manual data parallel: average (or sum) gradients over the ranks, in fused buckets.

`DistributedGradReducer` groups the parameters that require grad at the call into buckets of
at most `bucket_mb` MiB (same dtype and device, in parameter order; a parameter listed twice
counts once), and per bucket sums the ranks' gradients, each divided by the degree first when
`mean` (as DDP: a float16 sum does not overflow where one rank's gradient is finite), in one
flat buffer kept across steps (`communication._grad_sum.sum_gradients`). The buffer is laid out
from the parameters, so the ranks agree whichever gradients each holds: a missing one counts as
zeros, and stays None only where it is None on every rank. A sparse COO gradient
(``nn.Embedding(sparse=True)``) is reduced on its own and made sparse again
(`communication._sparse.all_reduce_sparse`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from shardwise.communication._grad_sum import buffer_numel, sum_gradients, sum_sparse
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
            (a layer unfrozen later is reduced from then on).
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
        self._sparse_dims: dict[int, int] = {}  # id of a parameter with sparse gradients

    def __call__(
        self, grads: Sequence[torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor | None, ...] | None:
        """Reduce ``p.grad`` of every parameter in place (no argument), or return reduced
        copies of `grads`.

        In place, the parameters that require grad at this call take part, whichever of them
        have a ``.grad`` on this rank (a data-dependent branch uses a layer on some ranks only):
        a missing gradient counts as zeros, and ``.grad`` stays None only where it is None on
        every rank (`communication._grad_sum`). None entries of `grads`
        (``torch.autograd.grad(..., allow_unused=True)``) are returned as None; they give no
        shape, so every rank must have the same ones.
        """
        divisor = (self.degree or get_group_size(self.group)) if self.mean else 1
        if grads is not None:
            return self._reduce_copies(grads, divisor)
        params = [p for p in self.parameters if p.requires_grad]
        for i, p in enumerate(params):
            _coo(p.grad, i)
        dense = [p for p in params if id(p) not in self._sparse_dims]
        for bucket in _buckets(dense, self.bucket_bytes):
            self._reduce_bucket([dense[i] for i in bucket], divisor)
        for i, p in enumerate(params):
            if id(p) in self._sparse_dims:
                p.grad = sum_sparse(
                    p, _coo(p.grad, i), divisor, self.group, self._sparse_dims[id(p)]
                )
        return None

    def _reduce_bucket(self, params: list[torch.Tensor], divisor: float) -> None:
        """One bucket's gradients summed (/ `divisor`) in its flat buffer (reused across calls)
        and copied back; a parameter found sparse on some rank is summed on its own from now on
        (`__call__`), on every rank alike (the counts say so to all)."""
        key = tuple((p.shape, p.dtype, p.device) for p in params)
        flat = self._bucket_buffers.get(key)
        if flat is None:
            real, device = params[0].dtype.to_real(), params[0].device
            flat = torch.empty(buffer_numel(params), dtype=real, device=device)
            self._bucket_buffers[key] = flat
        summed = sum_gradients(params, [p.grad for p in params], divisor, self.group, flat)
        for p, out in zip(params, summed, strict=True):
            if not out.used:
                p.grad = None
            elif out.sparse_dim:
                self._sparse_dims[id(p)] = out.sparse_dim
                self._bucket_buffers.clear()  # (the next calls lay the buckets out without it)
            elif p.grad is None or p.grad.layout != torch.strided:
                p.grad = out.dense.clone()
            else:
                p.grad.copy_(out.dense)

    def _reduce_copies(
        self, grads: Sequence[torch.Tensor | None], divisor: float
    ) -> tuple[torch.Tensor | None, ...]:
        """The tuple form: reduced copies of `grads` (dense ones in buckets, a sparse one on its
        own), None entries returned as None."""
        copies = [None if g is None else g.detach().clone() for g in grads]
        dense = [c for c in copies if c is not None and c.layout == torch.strided]
        for bucket in _buckets(dense, self.bucket_bytes):
            parts = [dense[i] for i in bucket]
            for part, out in zip(
                parts, sum_gradients(parts, parts, divisor, self.group), strict=True
            ):
                part.copy_(out.dense)
        return tuple(
            c if c is None or c.layout == torch.strided else self._sparse(c, i, divisor)
            for i, c in enumerate(copies)
        )

    def _sparse(self, g: torch.Tensor, i: int, divisor: float) -> torch.Tensor:
        """A sparse gradient of the tuple form reduced, sparse again."""
        _coo(g, i)
        return all_reduce_sparse(g, self.group, divisor)


def _coo(g: torch.Tensor | None, i: int) -> torch.Tensor | None:
    """`g` checked: None, dense or sparse COO (``nn.Embedding(sparse=True)``).

    Raises:
        TypeError: another layout (CSR, CSC, BSR), naming gradient `i`.
    """
    if g is not None and g.layout not in (torch.strided, torch.sparse_coo):
        raise TypeError(
            f"DistributedGradReducer: gradient {i} has layout {g.layout}; only dense and "
            f"sparse COO gradients (nn.Embedding(sparse=True)) are reduced"
        )
    return g
