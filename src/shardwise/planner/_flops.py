"""A rough count of an op's floating-point work, for the search's compute cost.

`node_flops(op, in_shapes, out_shapes)`: matrix products (``F.linear``, ``torch.matmul`` /
``mm`` / ``bmm``, ``addmm`` / ``baddbmm``, shardwise's ``MatMul`` / ``BatchMatMul``) count
2 · (the output's elements) · (the contracted size); attention
(``scaled_dot_product_attention``) 4 · (q's elements) · (k's sequence length); convolutions
2 · (output elements) · (weight elements / output channels); every other op counts its
outputs' elements (one operation each).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_PRODUCTS = {
    "torch.nn.functional.linear",
    "torch.matmul",
    "torch.Tensor.matmul",
    "torch.Tensor.__matmul__",
    "torch.mm",
    "torch.Tensor.mm",
    "torch.bmm",
    "torch.Tensor.bmm",
    "shardwise.ops.MatMul",
    "shardwise.ops.BatchMatMul",
}
_ADDMM = {"torch.addmm", "torch.Tensor.addmm", "torch.baddbmm", "torch.Tensor.baddbmm"}
_ATTENTION = "torch.nn.functional.scaled_dot_product_attention"
_CONVS = {"torch.nn.functional.conv2d", "torch.nn.functional.conv1d", "shardwise.ops.Conv2D"}


def node_flops(
    op: str, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]]
) -> int:
    """The op's floating-point operations over its global shapes (see the module docstring).

    Example:
        >>> node_flops("torch.nn.functional.linear", [(8, 32), (64, 32)], [(8, 64)])
        32768
    """
    out = sum(math.prod(s) for s in out_shapes)
    if not in_shapes or not out_shapes or not out_shapes[0]:
        return out
    if op in _PRODUCTS and len(in_shapes) >= 2:
        return _product_flops(op, in_shapes, out_shapes[0])
    if op in _ADDMM and len(in_shapes) >= 3:  # (bias, a, b): the product of a and b
        return _product_flops(op, in_shapes[1:], out_shapes[0])
    if op == _ATTENTION and len(in_shapes) >= 2 and len(in_shapes[1]) >= 2:
        return 4 * math.prod(in_shapes[0]) * int(in_shapes[1][-2])
    if op in _CONVS and len(in_shapes) >= 2 and len(out_shapes[0]) >= 2:
        channels = int(out_shapes[0][1])
        return 2 * math.prod(out_shapes[0]) * (math.prod(in_shapes[1]) // max(channels, 1))
    return out


def _product_flops(op: str, ins: Sequence[Sequence[int]], out: Sequence[int]) -> int:
    """2 · (the output's elements) · K, with K input 0's last dim (``[..., K]`` for linear,
    matmul, matrix-vector and broadcast-batched products; a transposed first operand, as
    ``MatMul(transpose_a=True)``, is approximated the same way)."""
    if not ins[0]:
        return math.prod(out)
    k = int(ins[0][-1])
    return 2 * max(math.prod(out), 1) * k
