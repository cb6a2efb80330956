"""A rough count of an op's floating-point work, for the search's compute cost.

`node_flops(op, in_shapes, out_shapes)`: matrix products (``F.linear``, ``torch.matmul`` /
``mm`` / ``bmm``, shardwise's ``MatMul`` / ``BatchMatMul``) count 2 · (input 0's elements) ·
(the output's last dim), attention (``scaled_dot_product_attention``) 4 · (q's elements) ·
(k's sequence length), convolutions 2 · (output elements) · (weight elements / output
channels); every other op counts its outputs' elements (one operation each).
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
    if op in _PRODUCTS:
        return 2 * math.prod(in_shapes[0]) * int(out_shapes[0][-1])
    if op == _ATTENTION and len(in_shapes) >= 2 and len(in_shapes[1]) >= 2:
        return 4 * math.prod(in_shapes[0]) * int(in_shapes[1][-2])
    if op in _CONVS and len(in_shapes) >= 2 and len(out_shapes[0]) >= 2:
        channels = int(out_shapes[0][1])
        return 2 * math.prod(out_shapes[0]) * (math.prod(in_shapes[1]) // max(channels, 1))
    return out
