"""`ReduceOp`: the reduction of AllReduce / ReduceScatter, with MindSpore's names.

- `ReduceOp.torch_op`: the ``torch.distributed`` reduction a collective is issued with.
- `ReduceOp.reduce` / `ReduceOp.reduce_parts`: the same reduction done locally, in index order
  (gloo's `reduce_scatter` reduces the chunks it received this way; so does the simulator).
- `as_reduce_op`: a `ReduceOp` from itself or its name (``"sum"``, ``"max"``, ...).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


class ReduceOp(enum.Enum):
    """Reduction of AllReduce / ReduceScatter, with MindSpore's names."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    def torch_op(self) -> dist.ReduceOp.RedOpType:
        return {
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.PROD: dist.ReduceOp.PRODUCT,
        }[self]

    def reduce(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Reduce `t` along `dim` locally, in index order (deterministic)."""
        return self.reduce_parts(t.unbind(dim))

    def reduce_parts(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Reduce equal-shape `parts` in index order into a new tensor (deterministic; the
        first step writes a fresh result, the later ones update it in place)."""
        if len(parts) == 1:
            return parts[0].clone()
        fns: dict[ReduceOp, Callable[..., torch.Tensor]] = {
            ReduceOp.SUM: torch.add,
            ReduceOp.PROD: torch.mul,
            ReduceOp.MAX: torch.maximum,
            ReduceOp.MIN: torch.minimum,
        }
        fn = fns[self]
        out = fn(parts[0], parts[1])
        for p in parts[2:]:
            fn(out, p, out=out)
        return out


def as_reduce_op(op: ReduceOp | str) -> ReduceOp:
    """Accept a `ReduceOp` or its name (``"sum"``, ``"max"``, ...).

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp(str(op).lower())
    except ValueError:
        names = ", ".join(o.name for o in ReduceOp)
        raise ValueError(f"op={op!r} is not a reduction; use ReduceOp.{{{names}}}") from None
