"""A rough count of an op's work: floating-point operations and memory traffic.

`node_flops(op, in_shapes, out_shapes)`: matrix products (``F.linear``, ``torch.matmul`` /
``mm`` / ``bmm``, ``addmm`` / ``baddbmm``, shardwise's ``MatMul`` / ``BatchMatMul``) count
2 · (the output's elements) · (the contracted size); attention
(``scaled_dot_product_attention``) 4 · (q's elements) · (k's sequence length); convolutions
2 · (output elements) · (weight elements / output channels); every other op counts its
outputs' elements (one operation each). The search prices these at ``flops_per_s``.

`node_elements(op, in_shapes, out_shapes)`: the elements the op reads and writes (its inputs'
and outputs'), for a step estimate's memory-bound ops (`_plan_cost.step_cost`): a view
(``view``, ``transpose``, ``split`` ...) moves none, an embedding reads only the rows it
returns (its indices and its output, not the whole table).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardwise.planner._draws import SDPA

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
_CONVS = {"torch.nn.functional.conv2d", "torch.nn.functional.conv1d", "shardwise.ops.Conv2D"}
_VIEWS = {
    "view", "reshape", "transpose", "permute", "split", "chunk", "unbind", "unsqueeze",
    "squeeze", "flatten", "unflatten", "expand", "narrow", "t", "__getitem__", "view_as",
    "reshape_as", "expand_as", "movedim", "swapaxes", "select", "detach", "size", "dim",
}  # fmt: skip
_EMBEDDINGS = {"torch.nn.functional.embedding"}  # (indices, table)


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
    if op == SDPA and len(in_shapes) >= 2 and len(in_shapes[1]) >= 2:
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


def is_view(op: str) -> bool:
    """Whether `op` (``torch.Tensor.view``, ``torch.transpose`` ...) only relabels memory."""
    return op.rsplit(".", 1)[-1] in _VIEWS


def node_elements(
    op: str, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]]
) -> int:
    """The elements `op` reads and writes over these shapes (see the module docstring).

    Example:
        >>> node_elements("torch.nn.functional.gelu", [(8, 64)], [(8, 64)])
        1024
        >>> node_elements("torch.Tensor.view", [(8, 64)], [(512,)])
        0
    """
    if is_view(op):
        return 0
    out = sum(math.prod(s) for s in out_shapes)
    if op in _EMBEDDINGS and in_shapes:
        return math.prod(in_shapes[0]) + out  # the indices, then the rows read and written
    return sum(math.prod(s) for s in in_shapes) + out
