"""Shape and reduction primitives: `Flatten`, `Reshape`, `Transpose`, `ReduceSum`, `ReduceMean`,
`ReduceMax`.

Non-tensor arguments are call arguments, as in MindSpore: ``Reshape()(x, shape)``,
``Transpose()(x, perm)``, ``ReduceSum(keep_dims)(x, axis)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardwise.ops._base import REQUIRED, Primitive
from shardwise.ops._specs import axes_of, norm_perm

AxisArg = int | Sequence[int]


class Flatten(Primitive):
    """``[N, ...] -> [N, prod(...)]`` (MindSpore ``ops.Flatten``).

    Strategy: dim 0 and the first flattened dim may be split (``((8, 1, 1, 1),)``); the other
    flattened dims not (their blocks would not be contiguous in the output).
    """

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            raise ValueError(f"{self.who}: Flatten needs an input of >= 1 dim")
        if x.numel() == 0:  # (reshape cannot infer -1 from zero elements: an empty batch)
            return x.reshape(x.shape[0], math.prod(x.shape[1:]))
        return x.reshape(x.shape[0], -1)


class Reshape(Primitive):
    """``x`` with a new shape (MindSpore ``ops.Reshape``); call ``op(x, shape)``, ``-1`` allowed.

    Strategy (on the input): the dims are grouped into runs that merge or split together; in
    each run only the outermost input dim may be split, and its split goes to the run's
    outermost output dim (which it must divide). E.g. [B*S, H] split (2, 4) -> [B, S, n, H/n]
    split (2, 1, 4, 1).
    """

    call_args = (("shape", REQUIRED),)

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return x.reshape(tuple(shape))


class Transpose(Primitive):
    """``x`` with its dims permuted (MindSpore ``ops.Transpose``); call ``op(x, perm)``.

    Any strategy; output dim k is split like input dim ``perm[k]``.
    """

    call_args = (("perm", REQUIRED),)

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, perm: Sequence[int]) -> torch.Tensor:
        return x.permute(norm_perm(perm, x.dim(), self.who))


def _dims(axis: AxisArg, rank: int, who: str) -> tuple[int, ...]:
    """`axis` (an int, a tuple or list of ints, ``()``) as non-negative dims, checked: each in
    ``[-rank, rank)``, none twice (ValueError naming `who`; an axis out of range reduced
    another dim before)."""
    if isinstance(axis, tuple | list) and not axis:
        return ()
    return axes_of(axis, rank, who)


class _Reduce(Primitive):
    """ReduceSum / ReduceMean / ReduceMax: ``op(x, axis=())``; ``()`` reduces every dim (unless
    `skip_mode`, then x is returned as is).

    Args:
        keep_dims: keep the reduced dims with size 1.
        skip_mode: with an empty axis, skip the reduction.

    Any strategy; a split reduced dim leaves partial results combined by an AllReduce over its
    axes (sum; mean for ReduceMean; max for ReduceMax).
    """

    call_args = (("axis", ()),)

    def __init__(self, keep_dims: bool = False, skip_mode: bool = False) -> None:
        if not isinstance(keep_dims, bool) or not isinstance(skip_mode, bool):
            raise TypeError(f"{self.name}: keep_dims and skip_mode must be bools")
        super().__init__(keep_dims=keep_dims, skip_mode=skip_mode)

    def _reduce(self, x: torch.Tensor, axis: AxisArg, how: str) -> torch.Tensor:
        args = self.init_args()
        dims = _dims(axis, x.dim(), self.who)
        if not dims:
            if args["skip_mode"]:
                return x
            dims = tuple(range(x.dim()))
        if not dims:  # a 0-dim tensor
            return x.clone()
        keep = bool(args["keep_dims"])
        if how == "max":
            return x.amax(dim=dims, keepdim=keep)
        return x.mean(dim=dims, keepdim=keep) if how == "mean" else x.sum(dim=dims, keepdim=keep)


class ReduceSum(_Reduce):
    """Sum over `axis` (MindSpore ``ops.ReduceSum``); see `_Reduce`."""

    def forward(self, x: torch.Tensor, axis: AxisArg = ()) -> torch.Tensor:
        return self._reduce(x, axis, "sum")


class ReduceMean(_Reduce):
    """Mean over `axis` (MindSpore ``ops.ReduceMean``); see `_Reduce`."""

    def forward(self, x: torch.Tensor, axis: AxisArg = ()) -> torch.Tensor:
        return self._reduce(x, axis, "mean")


class ReduceMax(_Reduce):
    """Maximum over `axis` (MindSpore ``ops.ReduceMax``); see `_Reduce`.

    A split reduced dim: each rank takes the maximum of its block, then an AllReduce(max) over
    the split axes (as MindSpore inserts). Its gradient goes to the elements equal to the
    maximum, split evenly between equal ones within a rank's block (as one device splits it
    between all of them); equal maxima on different ranks each get the whole gradient (as
    MindSpore's AllReduce(max) adjoint does), so only exact ties across ranks differ from one
    device.

    Example:
        >>> m = ReduceMax(keep_dims=True).shard(((2, 4),))(x, -1)  # AllReduce(max) over 4
    """

    def forward(self, x: torch.Tensor, axis: AxisArg = ()) -> torch.Tensor:
        return self._reduce(x, axis, "max")
