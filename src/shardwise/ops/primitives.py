"""The shardable compute primitives (``sw.ops.MatMul`` ...), as `torch.nn.Module`s.

Each takes MindSpore's constructor arguments, computes the single-device result with torch ops in
``forward`` (so a network built from them trains on one device as is), and records strategies
with ``.shard(in_strategy, out_strategy)`` (`shardwise.ops._base.Primitive`). How a strategy
lays a primitive out on the devices is its rule in `shardwise.ops.rules.RULES`.

This module holds the matrix products, the elementwise and activation families (one table each:
`_BINARY`, `_UNARY`), Cast and Softmax / LogSoftmax; `_nn_primitives` holds LayerNorm,
BatchNorm, SoftmaxCrossEntropyWithLogits and Gather; `_dropout` Dropout; `_cnn_primitives`
Conv2D, MaxPool and AvgPool; `_shape_primitives` Flatten, Reshape, Transpose and the
reductions. All are re-exported here.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops._base import REQUIRED, Primitive
from shardwise.ops._cnn_primitives import AvgPool, Conv2D, MaxPool
from shardwise.ops._dropout import Dropout
from shardwise.ops._nn_primitives import (
    BatchNorm,
    Gather,
    LayerNorm,
    SoftmaxCrossEntropyWithLogits,
)
from shardwise.ops._shape_primitives import (
    Flatten,
    ReduceMax,
    ReduceMean,
    ReduceSum,
    Reshape,
    Transpose,
)
from shardwise.ops._specs import axes_of

Operand = torch.Tensor | float | int


def _flag(value: object, name: str, who: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{who}: {name} must be a bool, got {value!r}")
    return value


class _Product(Primitive):
    """MatMul / BatchMatMul: the transpose flags."""

    def __init__(self, transpose_a: bool = False, transpose_b: bool = False) -> None:
        super().__init__(
            transpose_a=_flag(transpose_a, "transpose_a", self.name),
            transpose_b=_flag(transpose_b, "transpose_b", self.name),
        )


class MatMul(_Product):
    """``x @ w`` for 2-D tensors (MindSpore ``ops.MatMul``).

    Args:
        transpose_a: use ``x.T`` ([K, M] input).
        transpose_b: use ``w.T`` ([N, K] input).

    Strategy ``((a, b), (b, c))`` (device matrix ``[a, b, c]``): a split K (b > 1) leaves
    partial sums, combined by an AllReduce over that axis, or a ReduceScatter onto dim 0 with
    ``out_strategy=((a * b, c),)``.

    Example:
        >>> y = MatMul().shard(((2, 4), (4, 1)))(x, w)     # [32, 784] @ [784, 512]
    """

    input_names = ("x", "w")

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or w.dim() != 2:
            raise ValueError(
                f"{self.who}: MatMul takes 2-D tensors, got {list(x.shape)} and {list(w.shape)}; "
                f"use BatchMatMul for batches"
            )
        a = x.t() if self.init_args()["transpose_a"] else x
        b = w.t() if self.init_args()["transpose_b"] else w
        return a @ b


class BatchMatMul(_Product):
    """Batched ``x @ y`` over leading (broadcast) batch dims (MindSpore ``ops.BatchMatMul``).

    The transpose flags swap the last two dims. Strategy: one value per dim of each input, the
    batch dims split alike, K split alike (-> AllReduce over its axes).

    Example:
        >>> scores = BatchMatMul(transpose_b=True).shard(((2, 4, 1, 1), (2, 4, 1, 1)))(q, k)
    """

    input_names = ("x", "y")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = x.transpose(-1, -2) if self.init_args()["transpose_a"] else x
        b = y.transpose(-1, -2) if self.init_args()["transpose_b"] else y
        return torch.matmul(a, b)


_BINARY: dict[str, Callable[[Any, Any], torch.Tensor]] = {
    "Add": operator.add,
    "Sub": operator.sub,
    "Mul": operator.mul,
    "Div": operator.truediv,
}


class _Binary(Primitive):
    """An elementwise binary op with NumPy broadcasting (see `_BINARY`)."""

    input_names = ("x", "y")

    def __init__(self) -> None:
        super().__init__()

    def __call__(self, x: Operand, y: Operand) -> torch.Tensor:  # type: ignore[override]
        """A Python number operand is passed as a 0-d tensor (its strategy entry ``()``, which
        a strategy naming the tensor operand's entry only may leave out: `rules.
        plan_primitive`), so that the planner sees both inputs; torch promotes a 0-d tensor as
        it does the number."""
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            ref = x if isinstance(x, torch.Tensor) else y
            assert isinstance(ref, torch.Tensor)
            x, y = (v if isinstance(v, torch.Tensor) else torch.tensor(v, device=ref.device)
                    for v in (x, y))  # fmt: skip
        out: torch.Tensor = super().__call__(x, y)
        return out

    def forward(self, x: Operand, y: Operand) -> torch.Tensor:
        return _BINARY[self.name](x, y)


class Add(_Binary):
    """``x + y`` with broadcasting. Strategy: one tuple per input, equal on shared dims,
    1 on broadcast dims (``((8, 1), (1,))`` for a [N, C] + [C] bias)."""


class Sub(_Binary):
    """``x - y`` with broadcasting (strategy as `Add`)."""


class Mul(_Binary):
    """``x * y`` with broadcasting (strategy as `Add`)."""


class Div(_Binary):
    """``x / y`` (true division) with broadcasting (strategy as `Add`)."""


class BiasAdd(Primitive):
    """``input_x + bias`` on the channel dim (MindSpore ``ops.BiasAdd``).

    Args:
        data_format: ``"NCHW"`` / ``"NCDHW"`` (channel = dim 1; also 2-D [N, C]) or ``"NHWC"``
            (channel = last dim).

    Strategy: ``((n, c, ...), (c,))``: the bias split like the channel dim.
    """

    input_names = ("input_x", "bias")

    def __init__(self, data_format: str = "NCHW") -> None:
        if data_format not in ("NCHW", "NHWC", "NCDHW"):
            raise ValueError(
                f"BiasAdd: data_format must be NCHW, NHWC or NCDHW, got {data_format!r}"
            )
        super().__init__(data_format=data_format)

    def forward(self, input_x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if self.init_args()["data_format"] == "NHWC":
            return input_x + bias
        shape = [1] * input_x.dim()
        shape[1] = -1
        return input_x + bias.reshape(shape)


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "ReLU": torch.relu,
    # MindSpore's GeLU primitive is the tanh form: its documented GeLU()([1, 2, 3]) is
    # [0.841192, 1.9545976, 2.9963627] (the erf form gives 0.8413447, 1.9544997, 2.9959505).
    "GeLU": lambda x: F.gelu(x, approximate="tanh"),
    "Sigmoid": torch.sigmoid,
    "Tanh": torch.tanh,
    "Exp": torch.exp,
    "Log": torch.log,
}


class _Unary(Primitive):
    """An elementwise activation (see `_UNARY`); any strategy with one value per dim."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _UNARY[self.name](x)


class ReLU(_Unary):
    """``max(x, 0)``. Example: ``ReLU().shard(((4, 1),))`` (on 8 devices: 2 replicas each)."""


class GeLU(_Unary):
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (MindSpore's GeLU primitive)."""


class Sigmoid(_Unary):
    """``1 / (1 + exp(-x))``."""


class Tanh(_Unary):
    """``tanh(x)``."""


class Exp(_Unary):
    """``e ** x`` (MindSpore ``ops.Exp``). Example: ``Exp().shard(((2, 4),))``."""


class Log(_Unary):
    """The natural logarithm of x (MindSpore ``ops.Log``)."""


def to_dtype(dtype: object, who: str) -> torch.dtype:
    """`dtype` as a torch dtype: a torch dtype, or its name (``"float16"``, ``"int32"``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise TypeError(
            f"{who}: dtype must be a torch dtype or its name (torch.float16, 'float32'), got "
            f"{dtype!r}"
        )
    return found


class Cast(Primitive):
    """``input_x`` converted to `dtype` (MindSpore ``ops.Cast``); call ``op(input_x, dtype)``.

    `dtype` is a torch dtype or its name. Elementwise: any strategy with one value per dim, the
    output laid out like the input (``Cast().shard(((8, 1),))(x, torch.float16)``).
    """

    input_names = ("input_x",)
    call_args = (("dtype", REQUIRED),)

    def __init__(self) -> None:
        super().__init__()

    def forward(self, input_x: torch.Tensor, dtype: object) -> torch.Tensor:
        return input_x.to(to_dtype(dtype, self.who))


class Softmax(Primitive):
    """Softmax over `axis` (an int or a tuple of ints; MindSpore ``ops.Softmax``).

    The strategy may split any dim except the axis (``((4, 1),)`` for axis=-1 on [N, C]).
    """

    def __init__(self, axis: int | tuple[int, ...] = -1) -> None:
        if isinstance(axis, list):
            axis = tuple(axis)
        super().__init__(axis=axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axis = self.init_args()["axis"]
        dims = axes_of(axis, x.dim(), self.who)  # (checked here: torch's error names no op)
        if isinstance(axis, int):
            return torch.softmax(x, axis)
        return torch.exp(x - torch.logsumexp(x, dim=dims, keepdim=True))


class LogSoftmax(Primitive):
    """``log(softmax(x))`` over `axis` (MindSpore ``ops.LogSoftmax``); the axis is not split."""

    def __init__(self, axis: int = -1) -> None:
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"LogSoftmax: axis must be an int, got {axis!r}")
        super().__init__(axis=axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, int(self.init_args()["axis"]))


__all__ = [
    "Add",
    "AvgPool",
    "BatchMatMul",
    "BatchNorm",
    "BiasAdd",
    "Cast",
    "Conv2D",
    "Div",
    "Dropout",
    "Exp",
    "Flatten",
    "Gather",
    "GeLU",
    "LayerNorm",
    "Log",
    "LogSoftmax",
    "MatMul",
    "MaxPool",
    "Mul",
    "ReLU",
    "ReduceMax",
    "ReduceMean",
    "ReduceSum",
    "Reshape",
    "Sigmoid",
    "Softmax",
    "SoftmaxCrossEntropyWithLogits",
    "Sub",
    "Tanh",
    "Transpose",
]
